"""The LM head on the CPU: a greedy step's exact argmax from an 8-bit pre-pass of the head
(bound.py), that pre-pass copy kept on disk and mapped so a later start does not build it
again (cache.py), and the running top-k of the logits while the head is computed a block of
the vocabulary at a time (topk.py)."""
