"""Tiny random targets built in-process: no downloads, a few milliseconds a forward."""
from __future__ import annotations

import os
import tempfile
from collections import Counter
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["EAGLE_LITE_CACHE"] = tempfile.mkdtemp(prefix="eagle-lite-cache-")   # measured step costs (cost.py)
torch.set_num_threads(1)  # tiny models: one thread is faster and immune to a busy machine

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers  # noqa: E402
from transformers import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from eagle_lite.targets.model import Target  # noqa: E402

VOCAB = 96


def snap_to_q4_1(weight: torch.Tensor) -> torch.Tensor:
    """What a GGUF Q4_1 round trip makes of an fp32 weight [N, K]: per 32 inputs, codes 0..15 between the
    group's min and max with fp16 scale d and minimum m (llama.cpp's quantizer), de-quantized as q * d + m."""
    n, k = weight.shape
    w = weight.reshape(n, k // 32, 32)
    low, high = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    d = (high - low) / 15
    q = torch.round((w - low) / torch.where(d > 0, d, torch.ones_like(d))).clamp(0, 15)
    return ((q * d.half().float()) + low.half().float()).reshape(n, k)


def snap_to_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """A GGUF Q8_0 round trip: per 32 inputs, d = absmax / 127 in fp16 and q = round(w / d)."""
    n, k = weight.shape
    w = weight.reshape(n, k // 32, 32)
    d = (w.abs().amax(-1, keepdim=True) / 127).half().float()
    return (torch.round(w / d).clamp(-127, 127) * d).reshape(n, k)


def make_target(family: str = "llama", seed: int = 0, hidden: int = 64, max_pos: int = 512,
                grid: bool = False, layers: int = 2) -> Target:
    """grid: the weights as SmolLM2's GGUF file de-quantizes them: the decoder's linears Q4_1, the lm_head Q8_0."""
    model = make_model(family, seed, hidden, max_pos, grid, layers)
    return Target(model, name=f"tiny-{family}{'-q4_1' if grid else ''}")


def make_model(family: str = "llama", seed: int = 0, hidden: int = 64, max_pos: int = 512,
               grid: bool = False, layers: int = 2):
    """make_target's transformers model, not yet wrapped: a Target on the CPU swaps its linears for CPU kernels,
    so a model meant for another device is moved there before it is wrapped."""
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos,
                  eos_token_id=None, bos_token_id=None, pad_token_id=0)
    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
               "qwen3": (Qwen3Config, Qwen3ForCausalLM), "mistral": (MistralConfig, MistralForCausalLM)}
    config_cls, model_cls = classes[family]
    model = model_cls(config_cls(**common))
    # Sharper next-token distributions than a fresh init, so greedy paths are not all ties
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
        if grid:
            for layer in model.model.layers.modules():
                if isinstance(layer, torch.nn.Linear):
                    layer.weight.copy_(snap_to_q4_1(layer.weight))
            model.lm_head.weight.copy_(snap_to_q8_0(model.lm_head.weight))
    return model.eval()


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def target(request) -> Target:
    return make_target(request.param)


FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]


@pytest.fixture(scope="session", params=FAMILIES)
def any_family(request) -> Target:
    """Every supported architecture; for the cheaper checks (the heavy matrix uses `target`)."""
    return make_target(request.param)


@pytest.fixture(scope="session")
def llama() -> Target:
    return make_target("llama")


def tv(counts: Counter, probs: dict, total: int) -> float:
    """The total variation distance between `total` draws counted in `counts` and the distribution `probs`."""
    keys = set(counts) | set(probs)
    return 0.5 * sum(abs(counts.get(k, 0) / total - probs.get(k, 0.0)) for k in keys)


def continuation_tv(target: Target, engine, prompt: list[int], sampling, tree, draws: int = 1000) -> float:
    """`tv` of `draws` 3-token continuations `engine` samples after `prompt` (seeds 0, 1, ...) from the target's
    exact law of them (`exact_continuations`)."""
    from eagle_lite.config import GenerationConfig

    counts = Counter()
    for seed in range(draws):
        cfg = GenerationConfig(max_new_tokens=3, sampling=sampling, tree=tree, seed=seed, stop_at_eos=False)
        counts[tuple(engine.generate(prompt, cfg).token_ids)] += 1
    return tv(counts, exact_continuations(target, prompt, sampling), draws)


def top_two_levels(model, ids: list[int], root: int, children: int, grandchildren: int) -> tuple[list[int], list[int]]:
    """A draft tree of the model's own top tokens after `ids`: `root`, its top `children`, and each child's top
    `grandchildren`, as (tokens, parents) in the order a tree lists them (parents first)."""
    def top(seq: list[int], k: int) -> list[int]:
        return model(input_ids=torch.tensor([seq])).logits[0, -1].topk(k).indices.tolist()

    tokens, parents = [root], [-1]
    for child in top(ids, children):
        tokens.append(child)
        parents.append(0)
        at = len(tokens) - 1
        for grandchild in top(ids + [child], grandchildren):
            tokens.append(grandchild)
            parents.append(at)
    return tokens, parents


def exact_continuations(target: Target, prompt: list[int], sampling, length: int = 3) -> dict[tuple, float]:
    """The target's exact distribution over `length`-token continuations, enumerated over the
    support of its sampling distribution (keep top_k small so the tree stays small)."""
    from eagle_lite.decoding.accept import target_probs

    exact: dict[tuple, float] = {}

    def walk(prefix: list[int], prob: float) -> None:
        if len(prefix) == length:
            exact[tuple(prefix)] = prob
            return
        p = target_probs(target.model(torch.tensor([prompt + prefix])).logits[0, -1], sampling)
        for tok in torch.nonzero(p).flatten().tolist():
            walk(prefix + [tok], prob * float(p[tok]))

    with torch.inference_mode():
        walk([], 1.0)
    return exact


CONF = Path(__file__).resolve().parents[1] / "conf"


def train_config(*overrides: str):
    """conf/train.yaml composed with Hydra's compose API, as `python -m trainers.train` would."""
    from hydra import compose, initialize_config_dir

    import trainers.train  # noqa: F401  (registers the resolvers conf/ uses)

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def tiny_train_config(runs: Path, *overrides: str):
    """The whole training pipeline on the tiny random target, quietly, under `runs`."""
    return train_config("target=tiny", "data=tiny", f"paths.root={runs}", "progress=false",
                        "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", *overrides)


def reference_greedy(target: Target, prompt: list[int], max_new_tokens: int, eos: int | None = None) -> list[int]:
    """transformers' own greedy generate(): the output every method must reproduce."""
    ids = torch.tensor([prompt])
    # an explicit all-ones mask: otherwise generate() masks out prompt tokens equal to pad_token_id
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                do_sample=False, eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}|{% endfor %}"
                 "{% if add_generation_prompt %}<a>{% endif %}")


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer of 96 ids (3 specials + 93 printable characters) with a chat template."""
    specials = ["<unk>", "<pad>", "<eos>"]
    chars = [chr(c) for c in range(32, 127)][:93]
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tiny_llama(path, max_position_embeddings: int, eos_token_id: int | None, lm_head_scale: float = 1.0):
    """Save a tiny random Llama (seed 0) with the character-level tokenizer and chat template into `path`."""
    tokenizer = tiny_tokenizer()
    tokenizer.save_pretrained(path)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_position_embeddings,
                         eos_token_id=eos_token_id, pad_token_id=1, bos_token_id=None)
    model = LlamaForCausalLM(config)
    if lm_head_scale != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(lm_head_scale)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama with a character-level tokenizer and a chat template, saved like a hub model."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-chat-model"), 256, eos_token_id=2, lm_head_scale=8.0)


def eagle_drafter(target, head, **options):
    """Method eagle's drafter for `head`, as the registry builds it (the head plus its prompt-lookup graft)."""
    from eagle_lite.drafters import EagleOptions, build

    return build("eagle", target, EagleOptions(head=head, **options))
