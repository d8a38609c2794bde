"""Decoding kernels: a few query rows against a long KV cache (``attention_with_kvcache``).

The forward ladder (kernels/forward/) gives one block a tile of query rows and loops it
over every key. With one new query row per (batch, head) that leaves a handful of
blocks, each with a long serial loop, and most of the GPU idle. Here the keys are split
instead: each block takes one range of one batch's keys, for the query rows that read the
same K/V head (GQA: up to two in split_kv, up to 16 in split_kv_mma, 8 in split_kv_mma_t), and a second small
kernel merges the splits by their
logsumexp, the online softmax's rescaling one level up (reference.combine_splits is its
NumPy sibling; reference.forward_splits the whole split computation).

    split_kv     one block per (split, row tile, batch x K/V head); each warp streams its
                 share of the split's keys with the online softmax, and the block's warps
                 merge by logsumexp at the end (the same merge as the splits')
    split_kv_mma the same split on the 16-bit tensor cores: a block's query rows are the
                 16 rows of the mma, K/V tiles copied by cp.async into shared memory
                 (float16 and bfloat16 caches with several rows per K/V head)
    split_kv_mma_t  split_kv_mma transposed: keys and head dims on the mma's M side, up to
                 8 query rows (a GQA group decoding one token) on its N side
    combine      one thread per output element: O = sum_s exp(L_s - L) O_s, L = log
                 sum_s exp(L_s); only launched with more than one split
    combine_batched  the same, each thread's loads issued 16 splits at a time (the same
                 bits; the default: policy.COMBINE_KERNEL)
    append       writes the new keys and values into the caches at each batch's length

``numbaflash/policy.py`` picks the kernel (``decode_kernel``) and the number of splits
(``default_num_splits``), and ``explain_kvcache`` says why. Each file holds its kernel factory and launch contract.
"""
