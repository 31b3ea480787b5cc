"""What a draft checkpoint may hold, parsed and checked: the z-lab `DFlashDraftModel` config
(`config.py`, its typed field readers in `fields.py`, the model's fields as the config class of
its `model_type` leaves them in `config_class.py`), what every config key and tensor means to
us (`contract.py`: served, metadata, or refused by name) and the draft's mask token
(`mask_token.py`).

The bottom of the package: it imports nothing of ours but the package root. No SGLang.
See docs/serving.md ("Draft checkpoints").
"""
