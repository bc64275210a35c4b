"""Choosing the next tokens from the logits: the sampler (sampler.py: the grammar mask,
logit bias and penalties, greedy or temperature with top-k, min-p and top-p, per-request
seeds, top logprobs) and the verification of speculative drafts, which keeps the longest
prefix the target accepts (rejection.py)."""
