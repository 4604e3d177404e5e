"""
The llama.cpp side of the llama.cpp bench: greedy generation with llama-cpp-python, driven over stdin/stdout.

Runs inside .venv-llamacpp (scripts/setup_llamacpp.sh) on the GGUFs of scripts/export_gguf.py; imports only the
standard library, numpy and llama_cpp. gemma_spec_ros/benchmarks/peers/llamacpp.py starts it and sends one JSON
request per line: {"system": name, "prompt_ids": [...], "max_new_tokens": n}; it answers one JSON line with the
tokens and the times it measured in-process (so the pipe costs nothing), or {"error": text}.

Every system decodes with the low-level API in a lean loop, as llama.cpp's own examples do: one llama_decode per
target pass, greedy picks from the logits, the KV cache cleared before each prompt (no prefix reuse). Speculative
systems verify a draft in one target pass and drop the rejected positions from the cache (llama_memory_seq_rm):

- ngram: llama-cpp-python's LlamaPromptLookupDecoding (max_ngram_size 2, num_pred_tokens K) proposes the drafts;
- draft: the draft model proposes K tokens greedily in its own context (llama.cpp's --draft-max, default 3).

    .venv-llamacpp/bin/python scripts/llamacpp_worker.py --gguf out/gguf --threads 1
    .venv-llamacpp/bin/python scripts/llamacpp_worker.py --gguf out/gguf --probe-mtp   # may abort the process

--measure FILE measures one GGUF in this fresh process and prints one JSON line (bench llamacpp-e2b): load time,
prompt processing of --prompt-tokens and --long-prompt tokens, greedy decode of --new-tokens after the shorter
prompt (end-of-generation tokens ignored: a random model's text means nothing), peak RSS, and the bytes a decode
step reads (every tensor but the per-layer token embeddings, of which a token reads one row).
"""

import argparse
import ctypes
import json
import resource
import sys
import time
from pathlib import Path

import llama_cpp
import numpy as np
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

PRECISIONS = ('f32', 'f16', 'q8_0')


class Model:
    """One GGUF with one context (n_ctx tokens, one sequence)."""

    def __init__(self, path: Path, threads: int, n_ctx: int, load_mtp: bool = False, ctx_other=None):
        params = llama_cpp.llama_model_default_params()
        params.load_mtp = load_mtp
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise RuntimeError('llama.cpp could not load {}'.format(path))
        context = llama_cpp.llama_context_default_params()
        context.n_ctx = context.n_batch = n_ctx
        context.n_threads = context.n_threads_batch = threads
        if ctx_other is not None:
            context.ctx_type = llama_cpp.LLAMA_CONTEXT_TYPE_MTP
            context.ctx_other = ctx_other
        self.ctx = llama_cpp.llama_init_from_model(self.model, context)
        if not self.ctx:
            raise RuntimeError('llama.cpp could not create a context for {}'.format(path))
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.batch = llama_cpp.llama_batch_init(n_ctx, 0, 1)

    def clear(self) -> None:
        llama_cpp.llama_memory_clear(self.memory, True)

    def drop_from(self, position: int) -> None:
        """Forget the cache from this position on (rejected drafts)."""
        llama_cpp.llama_memory_seq_rm(self.memory, 0, position, -1)

    def decode(self, tokens: list[int], start: int, all_logits: bool) -> list[int]:
        """Run tokens at positions start...; return the greedy next token after each (or after the last only)."""
        batch = self.batch
        for index, token in enumerate(tokens):
            batch.token[index] = token
            batch.pos[index] = start + index
            batch.n_seq_id[index] = 1
            batch.seq_id[index][0] = 0
            batch.logits[index] = all_logits or index == len(tokens) - 1
        batch.n_tokens = len(tokens)
        if llama_cpp.llama_decode(self.ctx, batch) != 0:
            raise RuntimeError('llama_decode failed')
        rows = range(len(tokens)) if all_logits else [len(tokens) - 1]
        return [int(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, row), shape=(self.n_vocab,))
                    .argmax()) for row in rows]

    def is_end(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self.vocab, token))


class DraftModelDrafter:
    """K greedy tokens from the draft model; its cache keeps the longest prefix it shares with the history."""

    def __init__(self, draft: Model, k: int):
        self.draft, self.k = draft, k
        self.cached: list[int] = []

    def reset(self) -> None:
        self.draft.clear()
        self.cached = []

    def __call__(self, history: list[int], budget: int) -> list[int]:
        keep = 0
        for cached, token in zip(self.cached, history, strict=False):
            if cached != token:
                break
            keep += 1
        keep = min(keep, len(history) - 1)  # the last token always runs, its logits give the first draft
        self.draft.drop_from(keep)
        drafts = self.draft.decode(history[keep:], keep, all_logits=False)
        self.cached = list(history)
        while len(drafts) < min(self.k, budget):
            drafts += self.draft.decode([drafts[-1]], len(self.cached), all_logits=False)
            self.cached.append(drafts[-2])
        return drafts[:min(self.k, budget)]


class LookupDrafter:
    """llama-cpp-python's prompt lookup: the continuation of the latest earlier match of the last 2 (or 1) tokens."""

    def __init__(self, k: int):
        self.lookup = LlamaPromptLookupDecoding(max_ngram_size=2, num_pred_tokens=k)

    def reset(self) -> None:
        pass

    def __call__(self, history: list[int], budget: int) -> list[int]:
        return [int(token) for token in self.lookup(np.array(history, dtype=np.intc))[:budget]]


def generate(target: Model, drafter, prompt_ids: list[int], max_new_tokens: int) -> dict:
    """Greedy generation; with a drafter, speculative rounds that keep exactly the target's greedy tokens."""
    target.clear()
    if drafter is not None:
        drafter.reset()
    started = time.perf_counter()
    tokens = target.decode(prompt_ids, 0, all_logits=False)
    first, first_cpu = time.perf_counter(), time.thread_time()  # n_threads 1: llama.cpp computes on this thread
    passes, drafted, accepted = 1, 0, 0
    position = len(prompt_ids)  # where the newest token (not yet in the cache) goes
    while len(tokens) < max_new_tokens and not target.is_end(tokens[-1]):
        budget = max_new_tokens - len(tokens) - 1  # drafts beyond it could never be kept
        drafts = drafter(prompt_ids + tokens, budget) if drafter is not None and budget > 0 else []
        picks = target.decode([tokens[-1]] + drafts, position, all_logits=bool(drafts))
        passes += 1
        taken = 0
        while taken < len(drafts) and drafts[taken] == picks[taken]:
            taken += 1
        drafted, accepted = drafted + len(drafts), accepted + taken
        new = drafts[:taken] + [picks[taken]]
        position += 1 + taken
        if taken < len(drafts):
            target.drop_from(position)
        for token in new:
            tokens.append(token)
            if target.is_end(token) or len(tokens) == max_new_tokens:
                break
    ended, ended_cpu = time.perf_counter(), time.thread_time()
    return {'token_ids': tokens, 'ttft_s': first - started, 'decode_s': ended - first, 'wall_s': ended - started,
            'decode_cpu_s': ended_cpu - first_cpu,
            'target_passes': passes, 'drafted_tokens': drafted, 'accepted_tokens': accepted}


def parse_system(name: str) -> tuple[str, str, int]:
    """'llamacpp-f32/none', 'llamacpp-q8_0/ngram/K10', 'llamacpp-f32/draft/K3' -> (precision, drafter, K)."""
    parts = name.split('/')
    precision = parts[0].removeprefix('llamacpp-')
    if precision not in PRECISIONS or len(parts) not in (2, 3) or (parts[1] == 'none') != (len(parts) == 2) or \
            parts[1] not in ('none', 'ngram', 'draft') or (len(parts) == 3 and not parts[2][1:].isdigit()):
        raise ValueError('unknown llama.cpp system {!r}'.format(name))
    return precision, parts[1], int(parts[2][1:]) if len(parts) == 3 else 0


class Worker:
    def __init__(self, gguf: Path, threads: int, n_ctx: int):
        self.gguf, self.threads, self.n_ctx = gguf, threads, n_ctx
        self.models: dict[str, Model] = {}
        self.drafters: dict[str, object] = {}

    def model(self, role: str, precision: str) -> Model:
        key = '{}-{}'.format(role, precision)
        if key not in self.models:
            self.models[key] = Model(self.gguf / 'gemma4-spec-{}.gguf'.format(key), self.threads, self.n_ctx)
        return self.models[key]

    def run(self, request: dict) -> dict:
        precision, drafter_name, k = parse_system(request['system'])
        drafter = None
        if drafter_name != 'none':
            if request['system'] not in self.drafters:
                self.drafters[request['system']] = (LookupDrafter(k) if drafter_name == 'ngram' else
                                                    DraftModelDrafter(self.model('draft', precision), k))
            drafter = self.drafters[request['system']]
        return generate(self.model('target', precision), drafter, list(request['prompt_ids']),
                        int(request['max_new_tokens']))


def probe_mtp(gguf: Path, threads: int, n_ctx: int) -> None:
    """Create the assistant's MTP context on the target's (llama.cpp may abort here) and draft one token."""
    target = Model(gguf / 'gemma4-spec-target-f32.gguf', threads, n_ctx)
    print('target loaded; creating the MTP context of the assistant', flush=True)
    Model(gguf / 'gemma4-spec-assistant-f32.gguf', threads, n_ctx, load_mtp=True, ctx_other=target.ctx)
    print('MTP context created', flush=True)


def step_bytes(path: Path) -> int:
    """Bytes of the tensors a decode step reads: all but the per-layer token embeddings (one row a token)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    return sum(int(tensor.n_bytes) for tensor in reader.tensors if tensor.name != 'per_layer_token_embd.weight')


def measure(path: Path, threads: int, prompt_tokens: int, long_prompt: int, new_tokens: int, seed: int) -> dict:
    """Load, prompt processing at two lengths, and plain greedy decode of one GGUF, in this process."""
    rng = np.random.default_rng(seed)
    prompt = [int(token) for token in rng.integers(10, 4000, size=max(prompt_tokens, long_prompt))]
    started = time.perf_counter()
    model = Model(path, threads, max(prompt_tokens, long_prompt) + new_tokens + 8)
    loaded = time.perf_counter() - started
    prompt_seconds = {}
    for length in sorted({prompt_tokens, long_prompt} - {0}):
        model.clear()
        started = time.perf_counter()
        model.decode(prompt[:length], 0, all_logits=False)
        prompt_seconds[length] = time.perf_counter() - started
    model.clear()  # decode after the shorter prompt
    tokens = model.decode(prompt[:prompt_tokens], 0, all_logits=False)
    started = time.perf_counter()
    while len(tokens) < new_tokens:
        tokens += model.decode(tokens[-1:], prompt_tokens + len(tokens) - 1, all_logits=False)
    decode_s = time.perf_counter() - started
    return {'gguf': path.name, 'threads': threads, 'load_s': round(loaded, 2),
            'prompt_tokens_per_s': {str(n): round(n / s, 2) for n, s in prompt_seconds.items()},
            'decode_tokens_per_s': round((new_tokens - 1) / decode_s, 3), 'new_tokens': new_tokens,
            'peak_rss_gib': round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20, 3),
            'step_bytes': step_bytes(path), 'file_bytes': path.stat().st_size, 'token_ids': tokens}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--gguf', help='folder of scripts/export_gguf.py')
    parser.add_argument('--threads', type=int, default=1)
    parser.add_argument('--n-ctx', type=int, default=2048)
    parser.add_argument('--probe-mtp', action='store_true')
    parser.add_argument('--measure', help='one GGUF file: measure it and exit')
    parser.add_argument('--prompt-tokens', type=int, default=512, help='--measure: prompt before the decode')
    parser.add_argument('--long-prompt', type=int, default=2048, help='--measure: a second prompt length (0: none)')
    parser.add_argument('--new-tokens', type=int, default=128, help='--measure')
    parser.add_argument('--seed', type=int, default=0, help='--measure: the random prompt')
    args = parser.parse_args()
    if not args.measure and not args.gguf:
        parser.error('give --gguf (a folder of GGUFs) or --measure (one GGUF file)')
    quiet = llama_cpp.llama_log_callback(lambda level, text, data: None)  # referenced until exit: C keeps calling it
    llama_cpp.llama_log_set(quiet, ctypes.c_void_p())
    llama_cpp.llama_backend_init()
    if args.measure:
        print(json.dumps(measure(Path(args.measure), args.threads, args.prompt_tokens, args.long_prompt,
                                 args.new_tokens, args.seed)), flush=True)
        return 0
    if args.probe_mtp:
        probe_mtp(Path(args.gguf), args.threads, args.n_ctx)
        return 0
    worker = Worker(Path(args.gguf), args.threads, args.n_ctx)
    print(json.dumps({'ready': True, 'llama_cpp': llama_cpp.__version__,
                      'system_info': llama_cpp.llama_print_system_info().decode()}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        try:
            answer = worker.run(request)
        except (ValueError, RuntimeError, KeyError) as error:
            answer = {'error': '{}: {}'.format(type(error).__name__, error)}
        print(json.dumps(answer), flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
