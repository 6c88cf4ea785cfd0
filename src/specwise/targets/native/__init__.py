"""Native-precision targets: GGUF blocks kept packed and multiplied by torch's int4/int8 CPU kernels."""
