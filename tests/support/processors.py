"""Custom logit processors for the tests, in an importable module: SGLang ships a processor to
its scheduler process serialized with dill, which pickles a class by reference to its module."""

from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor


class BanAfterK(CustomLogitProcessor):
    """Deterministic and history-dependent: once a request has `k` output tokens, bans the
    tokens in `custom_params["ban"]` and the last token of its sequence (prompt and outputs, read
    the way SGLang's own processors read them), so no token repeats the one before it."""

    def __call__(self, logits, custom_param_list=None):
        for row, params in enumerate(custom_param_list):
            req = params["__req__"]
            if len(req.output_ids) >= params["k"]:
                logits[row, params["ban"]] = -float("inf")
                logits[row, (req.origin_input_ids + req.output_ids)[-1]] = -float("inf")
        return logits
