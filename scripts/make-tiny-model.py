#!/usr/bin/env python3
"""Make a tiny random-weight Llama (and its BPE tokenizer) for running a real SGLang server on a CPU.

Run by the SGLang virtualenv's python (it has torch, transformers and tokenizers):

    python scripts/make-tiny-model.py OUT_DIR [--dtype float32|bfloat16]

``--dtype bfloat16`` saves the weights (and ``torch_dtype`` in config.json) in bf16, as real
models ship: SGLang then logs what it logs for them (on a CPU host, 0.5.23's "multimem
all-gather disabled (Found no NVIDIA driver ...)" warning at start-up).

Deterministic: the tokenizer is trained on a fixed, sorted list of local text files and the
weights come from a fixed seed, so the same library versions give the same files. No hub access.
"""

from __future__ import annotations

import glob
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SEED = 1234
VOCAB_SIZE = 1024
SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def corpus_files() -> list[str]:
    """A fixed set of local text: the licence texts, else the stdlib's own sources."""
    files = sorted(glob.glob("/usr/share/common-licenses/*"))
    files = [f for f in files if os.path.isfile(f)]
    if not files:
        stdlib = os.path.dirname(os.__file__)
        files = sorted(glob.glob(os.path.join(stdlib, "*.py")))[:40]
    if not files:
        raise SystemExit("make-tiny-model: no local text found to train the tokenizer on")
    return files


def texts(files: list[str]):
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            yield f.read()


def main() -> int:
    args = sys.argv[1:]
    dtype = "float32"
    if len(args) == 3 and args[1] == "--dtype" and args[2] in ("float32", "bfloat16"):
        dtype = args[2]
        args = args[:1]
    if len(args) != 1:
        print("usage: make-tiny-model.py OUT_DIR [--dtype float32|bfloat16]", file=sys.stderr)
        return 2
    out = args[0]
    os.makedirs(out, exist_ok=True)

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    # Tokenizer: byte-level BPE, ~1k tokens, trained on local text.
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts(corpus_files()), trainer=trainer)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=2048,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)

    # Model: 2 layers, hidden 64, random weights from a fixed seed.
    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    if dtype == "bfloat16":
        model = model.to(torch.bfloat16)
        model.config.dtype = torch.bfloat16
    model.generation_config.bos_token_id = fast.bos_token_id
    model.generation_config.eos_token_id = fast.eos_token_id
    model.generation_config.pad_token_id = fast.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    n = sum(p.numel() for p in model.parameters())
    print(f"make-tiny-model: {out}: {n} parameters ({dtype}), vocab {len(fast)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
