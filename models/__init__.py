"""Model definitions, layers, weight loaders and shipped benchmark configs.

Entry points (import them from their modules; this package imports nothing
so that `models.forward_context` stays cheap to import):
    models.config.ModelConfig          the shape the decoder is built from
    models.loader.load_model           (source, load_format, dtype, device) -> (model, ModelConfig)
    models.loader.load_hf_config       source -> transformers PretrainedConfig
    models.registry.get_model_class    architecture name -> nn.Module class
"""
