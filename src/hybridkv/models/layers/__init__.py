"""The kit model families are assembled from: one module per noun (norms, rotary, mlp, moe,
attention, the Mamba mixers and their scan, Gated DeltaNet, the recurrent-state helpers).
Families import the modules directly; nothing is re-exported here."""
