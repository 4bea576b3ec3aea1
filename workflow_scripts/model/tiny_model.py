"""The offline demo's model: a small Llama/Qwen2 config, random weights and a byte-level BPE
tokenizer trained on the normalised demo corpus. Same seed and corpus give the same files.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from workflow_scripts.core.errors import WorkflowError

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
# One user turn and the assistant's answer; lets chat_template variants run on the demo model too.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}"
    "{% if message['role'] != 'user' %}" + EOS_TOKEN + "{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
MAX_POSITIONS = 1024


def corpus_texts(corpus_dirs: Sequence[str | Path]) -> Iterator[str]:
    """Every string field of every normalised train row (questions, answers, derived fields)."""
    from workflow_scripts.data.normalised_data import open_normalised

    for directory in corpus_dirs:
        data = open_normalised(directory)
        for row in data["train"]:
            for value in row.values():
                if isinstance(value, str):
                    yield value
                elif isinstance(value, list):  # answers; or conversation turns, whose contents are text
                    for item in value:
                        if isinstance(item, str):
                            yield item
                        elif isinstance(item, dict):
                            yield from (part for part in item.values() if isinstance(part, str))


def train_tokenizer(texts: Iterator[str], vocab_size: int):
    """A byte-level BPE tokenizer (any text stays encodable), wrapped for transformers."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    # Words are split at whitespace only (not GPT-2's letter/digit/punctuation classes), so the
    # small vocabulary can learn whole graph tokens like " :ARG0" or " want-01": shorter sequences.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r" ?\S+|\s+"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, model_max_length=MAX_POSITIONS
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def check_heads(tiny: Mapping[str, Any]) -> None:
    if tiny["hidden_size"] % tiny["num_heads"]:
        raise WorkflowError(
            f"model.tiny.hidden_size {tiny['hidden_size']} is not divisible by model.tiny.num_heads {tiny['num_heads']}"
        )


def decoder_settings(tiny: Mapping[str, Any], tokenizer) -> dict[str, Any]:
    """The Llama/Qwen2 config arguments of the tiny decoder (also tiny_vlm's language model)."""
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=tiny["hidden_size"],
        intermediate_size=tiny["intermediate_size"],
        num_hidden_layers=tiny["num_layers"],
        num_attention_heads=tiny["num_heads"],
        num_key_value_heads=tiny["num_heads"],
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        # 1/sqrt(hidden) rather than 0.02: behind the final RMSNorm, a 0.02-scaled frozen output
        # layer caps every logit near +-1.3, so no adapter could make a confident prediction.
        initializer_range=tiny["hidden_size"] ** -0.5,
    )


def build_model(tiny: Mapping[str, Any], tokenizer):
    """A randomly initialised causal LM, seeded by ``tiny.seed``."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    check_heads(tiny)
    config_class = {"llama": LlamaConfig, "qwen2": Qwen2Config}[tiny["architecture"]]
    config = config_class(**decoder_settings(tiny, tokenizer))
    torch.manual_seed(tiny["seed"])
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def build(tiny: Mapping[str, Any], corpus_dirs: Sequence[str | Path], out: Path) -> dict[str, Any]:
    """Write config, safetensors weights and tokenizer into ``out``; return facts for the manifest."""
    return save_built(tiny, corpus_dirs, out, train_tokenizer, build_model)


def save_built(tiny: Mapping[str, Any], corpus_dirs: Sequence[str | Path], out: Path,
               train_tokenizer: Callable[[Iterator[str], int], Any], build_model: Callable[[Mapping[str, Any], Any], Any],
               corpus_texts: Callable[[Sequence[str | Path]], Iterator[str]] = corpus_texts) -> dict[str, Any]:
    """A tiny model's files from its tokenizer trainer and model builder (tiny_bert's too)."""
    if not corpus_dirs:
        raise WorkflowError("model.source 'tiny' needs --corpus: the normalised datasets to train its tokenizer on")
    tokenizer = train_tokenizer(corpus_texts(corpus_dirs), tiny["vocab_size"])
    model = build_model(tiny, tokenizer)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    return {
        "architecture": tiny["architecture"],
        "vocab_size": len(tokenizer),
        "requested_vocab_size": tiny["vocab_size"],
        "parameters": sum(p.numel() for p in model.parameters()),
        "corpus": [str(d) for d in corpus_dirs],
    }
