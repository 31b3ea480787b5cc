"""The frozen target: what the draft is conditioned on, embedded with, and trained against."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

from sglang_dflash.checkpoint.config import build_target_layer_ids
from sglang_dflash.train.config import TrainConfigError


@dataclass
class TargetOutput:
    features: torch.Tensor  # [b, S, K*H] hidden states after each layer in target_layer_ids
    predictions: torch.Tensor  # [b, S] argmax of the target's logits: its guess for token t+1


def resolve_target_layer_ids(
    layer_ids: Optional[tuple[int, ...]], num_layers: int, num_draft_layers: int
) -> tuple[int, ...]:
    """Check `--target-layer-ids` against the target, or pick the reference default.

    Id `i` is the output of target layer `i` (HF `hidden_states[i + 1]`). Serving captures it
    as the input of layer `i + 1`, so the last layer (`num_layers - 1`) cannot be used.
    """
    if layer_ids is None:
        try:
            return tuple(build_target_layer_ids(num_layers, num_draft_layers))
        except ValueError as e:
            raise TrainConfigError(f"{e}; pass --target-layer-ids") from e
    bad = [i for i in layer_ids if not 0 <= i <= num_layers - 2]
    if bad:
        raise TrainConfigError(
            f"--target-layer-ids {list(layer_ids)} names layer(s) {bad}, but the target has "
            f"{num_layers} layers (usable ids are 0..{num_layers - 2})"
        )
    return tuple(layer_ids)


def resolve_mask_token_id(
    tokenizer, vocab_rows: int, mask_token: Optional[str], mask_token_id: Optional[int]
) -> int:
    """The id of the block's MASK token: explicit id, named token, or the tokenizer's own."""
    if mask_token_id is not None:
        token_id, source = mask_token_id, f"--mask-token-id {mask_token_id}"
    elif mask_token is not None:
        vocab = tokenizer.get_vocab()
        if mask_token not in vocab:
            raise TrainConfigError(f"--mask-token {mask_token!r} is not in the target tokenizer's vocabulary")
        token_id, source = vocab[mask_token], f"--mask-token {mask_token!r}"
    elif getattr(tokenizer, "mask_token_id", None) is not None:
        token_id, source = tokenizer.mask_token_id, f"the tokenizer's mask token {tokenizer.mask_token!r}"
    else:
        raise TrainConfigError(
            "the target tokenizer has no mask token (tokenizer.mask_token is None); pass "
            "--mask-token with a token from its vocabulary, or --mask-token-id"
        )
    if not 0 <= token_id < vocab_rows:
        raise TrainConfigError(
            f"{source} gives id {token_id}, outside the target's embedding table ({vocab_rows} rows)"
        )
    return int(token_id)


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    if not os.path.isdir(path):
        raise TrainConfigError(f"--target {path!r} is not a directory")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise TrainConfigError(f"--target {path!r}: cannot load its tokenizer ({e})") from e
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


@dataclass
class TargetSpec:
    """What the draft needs to know about the target, read without loading its weights."""

    config: object  # the HF text config (the language model's, for multimodal wrappers)
    layer_ids: tuple[int, ...]
    mask_token_id: int


def inspect_target(
    path: str,
    tokenizer,
    *,
    num_draft_layers: int,
    target_layer_ids: Optional[tuple[int, ...]] = None,
    mask_token: Optional[str] = None,
    mask_token_id: Optional[int] = None,
) -> TargetSpec:
    """Validate the target against the recipe's settings before anything expensive runs."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path).get_text_config()
    except (OSError, ValueError) as e:
        raise TrainConfigError(f"--target {path!r}: cannot read its config.json ({e})") from e
    layer_ids = resolve_target_layer_ids(target_layer_ids, config.num_hidden_layers, num_draft_layers)
    mask_id = resolve_mask_token_id(tokenizer, config.vocab_size, mask_token, mask_token_id)
    return TargetSpec(config=config, layer_ids=layer_ids, mask_token_id=mask_id)


# The target's predictions are the argmax of at most this many bytes of logits at once.
PREDICT_CHUNK_BYTES = 128 * 2**20


class FrozenTarget:
    """A Hugging Face causal LM, frozen: features, predictions, embeddings and LM head.

    `forward` runs the decoder (not the LM head) with forward hooks on the layers in
    `layer_ids`, which keep their outputs (HF's `hidden_states[i + 1]`); the predictions are the
    LM head's argmax over the last hidden state in row chunks. So neither every layer's hidden
    states nor the [b, S, V] logits exist at once.
    """

    def __init__(self, model, layer_ids: tuple[int, ...]):
        self.model = model.eval().requires_grad_(False)
        self.layer_ids = layer_ids
        self.decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
        layers = getattr(self.decoder, "layers", None)
        if layers is None:
            raise TrainConfigError(
                f"the target {type(model).__name__} has no decoder with a `layers` list "
                "(model.get_decoder().layers), where the recipe captures its features"
            )
        self._captured: dict[int, torch.Tensor] = {}
        for i in layer_ids:
            layers[i].register_forward_hook(self._keeper(i))

    def _keeper(self, layer_id: int):
        def keep(module, args, output):
            self._captured[layer_id] = output[0] if isinstance(output, tuple) else output

        return keep

    @classmethod
    def load(cls, path: str, layer_ids: tuple[int, ...], device: torch.device) -> "FrozenTarget":
        """bf16 on CUDA, fp32 on CPU."""
        from transformers import AutoModelForCausalLM

        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
        return cls(model.to(device), layer_ids)

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight  # [V, H]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] -> the target's input embeddings [..., H]."""
        return self.model.get_input_embeddings()(ids)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> TargetOutput:
        """input_ids, attention_mask [b, S] (right-padded) -> features and predictions."""
        self._captured.clear()
        last = self.decoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # [b, S, H]
        features = torch.cat([self._captured[i] for i in self.layer_ids], dim=-1)  # [b, S, K*H]
        self._captured.clear()
        return TargetOutput(features=features, predictions=self.predict(last))

    def predict(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [b, S, H] (after the final norm) -> the LM head's argmax [b, S], in chunks."""
        head = self.model.get_output_embeddings()
        rows = hidden.reshape(-1, hidden.shape[-1])
        size = max(1, PREDICT_CHUNK_BYTES // (4 * head.weight.shape[0]))
        ids = [head(rows[lo : lo + size]).argmax(-1) for lo in range(0, rows.shape[0], size)]
        return torch.cat(ids).view(hidden.shape[:-1])
