"""The engine: model definitions, conversion, quantization, compilation and the runtime."""
