"""Linear-attention token mixers: Gated DeltaNet and its delta rule."""
