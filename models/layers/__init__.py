"""Building blocks of the decoder. Each layer's `forward` is plain torch and
calls its math through `models.layers.ops`, where a platform can swap in a
fused kernel once at start-up (`ops.set_op("rms_norm", fn)`)."""
