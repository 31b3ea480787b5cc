"""The draft's borrowed embedding and LM head (`target_head.TargetHead`), through the wrappers
SGLang may put around them, against what the target itself computes."""

import pytest
import torch
from torch import nn

from sglang_dflash.draft.target_head import TargetHead

pytestmark = pytest.mark.sglang  # imports SGLang's layers

H, V, PADDED = 16, 40, 48  # hidden size, real vocab, vocab padded as SGLang pads its heads


class Target(nn.Module):
    def __init__(self, embed, lm_head):
        super().__init__()
        self.embed_tokens, self.lm_head = embed, lm_head

    def get_input_embeddings(self):
        return self.embed_tokens


def _linear_head(weight):
    head = nn.Module()
    head.weight = nn.Parameter(weight, requires_grad=False)
    return head


def test_dense_head_drops_the_padding_rows():
    torch.manual_seed(0)
    weight = torch.randn(PADDED, H)
    head = TargetHead(Target(nn.Embedding(V, H), _linear_head(weight)), V)
    hidden = torch.randn(3, 5, H)
    assert head.kind == "dense"
    torch.testing.assert_close(head.logits(hidden), hidden @ weight[:V].T)


class Int8RowwiseLinearMethod:
    """A quantized head's method: int8 weights with per-row scales, dequantized in `apply`."""

    def apply(self, layer, x, bias=None):
        return x @ (layer.weight.float() * layer.scales[:, None]).T


def test_quantized_head_goes_through_its_quant_method():
    torch.manual_seed(1)
    weight = torch.randint(-127, 128, (PADDED, H), dtype=torch.int8)
    lm_head = _linear_head(weight)
    lm_head.scales = torch.rand(PADDED) / 64
    lm_head.quant_method = Int8RowwiseLinearMethod()
    head = TargetHead(Target(nn.Embedding(V, H), lm_head), V)
    hidden = torch.randn(2, 7, H)
    want = hidden @ (weight.float() * lm_head.scales[:, None])[:V].T  # what the target's logits are
    assert head.kind == "quantized (Int8RowwiseLinearMethod)"
    got = head.logits(hidden)
    assert got.shape == (2, 7, V)
    torch.testing.assert_close(got, want)
    # The raw int8 weights would give other proposals (so the check can fail).
    assert not torch.equal((hidden @ weight[:V].float().T).argmax(-1), want.argmax(-1))


def test_lora_wrappers_are_unwrapped():
    from sglang.srt.lora.layers import BaseLayerWithLoRA

    torch.manual_seed(2)
    embed, weight = nn.Embedding(V, H), torch.randn(V, H)

    def wrap(base):
        wrapper = object.__new__(BaseLayerWithLoRA)
        nn.Module.__init__(wrapper)
        wrapper.base_layer = base
        return wrapper

    head = TargetHead(Target(wrap(embed), wrap(_linear_head(weight))), V)
    assert head.embed is embed
    assert torch.equal(head.weight, weight)


def test_multimodal_wrapper_uses_its_language_models_head():
    torch.manual_seed(3)
    weight = torch.randn(V, H)
    language_model = Target(nn.Embedding(V, H), _linear_head(weight))

    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.language_model = language_model

        def get_input_embeddings(self):
            return language_model.get_input_embeddings()

    head = TargetHead(Wrapper(), V)
    assert torch.equal(head.weight, weight)

    class Headless(nn.Module):
        def get_input_embeddings(self):
            return nn.Embedding(V, H)

    with pytest.raises(ValueError, match="cannot find the LM head of Headless"):
        TargetHead(Headless(), V)


def test_scaled_embeddings_are_what_the_target_feeds_its_first_layer():
    """Gemma multiplies its embeddings by sqrt(hidden) inside the embedding module."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    torch.manual_seed(4)
    embed = Gemma3TextScaledWordEmbedding(V, H, padding_idx=0, embed_scale=H**0.5)
    head = TargetHead(Target(embed, _linear_head(torch.randn(V, H))), V)
    ids = torch.tensor([3, 9, 27])
    torch.testing.assert_close(head.embed(ids), embed.weight[ids] * H**0.5)


def test_a_trained_mask_row_reaches_the_draft_and_leaves_the_target_alone():
    """`mask_embedding.pt`: the draft's MASK rows get what SGLang's built-in feeds its draft,
    the module's forward on the trained row (here with Gemma's embedding scale); every other
    token, and the target's own table, stay as they are."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    torch.manual_seed(5)
    embed = Gemma3TextScaledWordEmbedding(V, H, padding_idx=0, embed_scale=H**0.5)
    table = embed.weight.detach().clone()
    head = TargetHead(Target(embed, _linear_head(torch.randn(V, H))), V)
    assert head.mask_row_kind == "target's"
    mask_id, trained = 7, torch.randn(H)
    head.use_trained_mask_row(mask_id, trained)
    ids = torch.tensor([3, 7, 7, 27])
    want = table[ids] * H**0.5
    want[1:3] = trained * H**0.5
    torch.testing.assert_close(head.embed(ids), want)
    assert torch.equal(embed.weight, table)  # the target embeds the mask token as before
    assert head.mask_row_kind == "trained (mask_embedding.pt)"


@pytest.mark.parametrize("trained", [False, True], ids=["as-stored", "trained-mask-row"])
def test_a_drafts_own_embedding_embeds_its_blocks_and_nothing_else(trained):
    """Nemotron-3.5: the block is embedded by the draft's own table (with a trained mask row
    written into it); the target's embedding stays the target's (LiLiCorr reads that one)."""
    torch.manual_seed(6)
    target_embed = nn.Embedding(V, H)
    head = TargetHead(Target(target_embed, _linear_head(torch.randn(V, H))), V)
    own = nn.Embedding(V, H)
    table = own.weight.detach().clone()
    row = torch.randn(H) if trained else None
    head.use_draft_embedding(own, 7, row)
    ids = torch.tensor([3, 7, 27])
    want = table[ids]
    if trained:
        want[1] = row
    torch.testing.assert_close(head.embed(ids), want)
    assert head.embedding is target_embed
    assert head.mask_row_kind == ("trained, in the draft's own table" if trained else "draft's own")


def test_a_head_kept_in_its_own_dtype_reads_the_drafts_hidden_states():
    """Beam keeps its LM head in bf16 in a float32 engine: the draft's hidden states are read in
    the head's dtype, as SGLang's logits processor reads the target's (no dtype error)."""
    torch.manual_seed(7)
    weight = torch.randn(V, H).to(torch.bfloat16)
    head = TargetHead(Target(nn.Embedding(V, H), _linear_head(weight)), V)
    hidden = torch.randn(3, H)  # float32
    want = torch.nn.functional.linear(hidden.to(torch.bfloat16), weight)
    torch.testing.assert_close(head.logits(hidden), want)
    assert torch.equal(head.argmax(hidden), want.argmax(-1))
