"""The dataset modules: one per `config.data.name`, each with its `DATASET` record (lra_core.dataset_record).

The registry (lra_core.registry.DATASET_PACKAGES) finds them here and in lra/ (the Long Range Arena sets)
by their record; the helpers they share (pipeline, packing, tokenizers, files, cache) stay in lra_core.data,
whose __init__.py describes what each module exposes.
"""
