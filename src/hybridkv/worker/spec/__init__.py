"""Speculative decoding's proposers on the worker side: drafts from a smaller model with the
target's vocabulary (draft_model.py) and from the target's own multi-token-prediction head
(mtp.py), made in the slots the scheduler reserves before the target scores them in the
same step (sampling/rejection.py keeps the accepted prefix)."""
