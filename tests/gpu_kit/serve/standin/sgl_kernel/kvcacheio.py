"""HiCache's KV transfers: imported by SGLang's scheduler, called only with HiCache on (the
stand-in raises if called; see sgl_kernel/__init__.py)."""

from sgl_kernel import _unsupported

NAMES = (
    "transfer_kv_all_layer",
    "transfer_kv_all_layer_direct_lf_pf",
    "transfer_kv_all_layer_lf_pf",
    "transfer_kv_all_layer_lf_ph",
    "transfer_kv_all_layer_mla",
    "transfer_kv_all_layer_mla_lf_pf",
    "transfer_kv_direct",
    "transfer_kv_per_layer",
    "transfer_kv_per_layer_direct_pf_lf",
    "transfer_kv_per_layer_mla",
    "transfer_kv_per_layer_mla_pf_lf",
    "transfer_kv_per_layer_pf_lf",
    "transfer_kv_per_layer_ph_lf",
)
globals().update({name: _unsupported(f"kvcacheio.{name}") for name in NAMES})
