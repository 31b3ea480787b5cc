"""Nanbeige's loop model (`make_family_target(family="nanbeige")`: Llama's layers run twice): its
loop fields and its oracle, transformers' Llama with the layers repeated (`nanbeige_unrolled`)."""

from __future__ import annotations

import json
import os

# A Nanbeige loop model runs its layers `num_loops` times; without the norm between the runs its
# forward is that of a Llama with the layers repeated (`nanbeige_unrolled`).
NANBEIGE_LOOPS = {"num_loops": 2, "skip_loop_final_norm": True}


def nanbeige_unrolled(path: str):
    """Transformers' Llama with the layers of the Nanbeige target at `path` repeated
    `num_loops` times: the reference for its forward."""
    import transformers
    from safetensors.torch import load_file

    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    layers, loops = raw["num_hidden_layers"], raw["num_loops"]
    skip = ("architectures", "model_type", "rope_theta", *NANBEIGE_LOOPS)
    fields = {k: v for k, v in raw.items() if k not in skip}
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**dict(fields, num_hidden_layers=layers * loops))
    )
    state = {}
    for name, tensor in load_file(os.path.join(path, "model.safetensors")).items():
        if name.startswith("model.layers."):
            i, rest = name[len("model.layers.") :].split(".", 1)
            for loop in range(loops):
                state[f"model.layers.{loop * layers + int(i)}.{rest}"] = tensor
        else:
            state[name] = tensor
    model.load_state_dict(state)
    return model.float().eval()
