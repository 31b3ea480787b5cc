"""What the multimodal targets share (Qwen3-VL, Qwen3-VL-MoE, the Qwen3.5 wrappers, Kimi-K2.5):
the one-block vision tower, the special token ids, the image and video processors; and
Qwen3-VL-MoE's expert layout as published. Builds no target itself."""

from __future__ import annotations

import os

# The multimodal wrappers' one-block vision tower and their special token ids (the top of the vocab).
VL_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4)
VL_TOKENS = dict(image_token_id=380, video_token_id=381, vision_start_token_id=382, vision_end_token_id=383)


def _transpose_fused_experts(path: str) -> None:
    """Write the fused expert tensors of the Qwen3-VL-MoE checkpoint at `path` as published:
    gate_up_proj [E, H, 2I] and down_proj [E, I, H], which SGLang's loader reads (it transposes
    them). Transformers saves its own layout, [E, 2I, H] and [E, H, I], and reads either, by shape:
    so 2I must differ from H."""
    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    state = load_file(file)
    for name, weight in state.items():
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            assert weight.shape[1] != weight.shape[2], name
            state[name] = weight.transpose(1, 2).contiguous()
    save_file(state, file, metadata={"format": "pt"})


def _save_vl_processor(path: str) -> None:
    """The image and video processors SGLang loads for a multimodal checkpoint."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    sizes = dict(patch_size=4, merge_size=2, temporal_patch_size=2)
    transformers.Qwen3VLProcessor(
        image_processor=transformers.Qwen2VLImageProcessor(**sizes),
        video_processor=transformers.Qwen3VLVideoProcessor(**sizes),
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
    ).save_pretrained(path)
