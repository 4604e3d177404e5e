"""Held-out evaluation of the drafters through the engine: tau, acceptance and wall-clock speedup per K."""

import json
import random
import re
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gemma_spec_ros.engine.stats import acceptance_rate, format_figure, tau, tokens_per_second
from gemma_spec_ros.train.corpora import corpus

CATEGORIES = ('code', 'docstring', 'extraction', 'free_text')


@dataclass(frozen=True)
class Prompt:
    category: str
    source: str
    text: str


@dataclass
class RunFigures:
    """Totals over a category's prompts for one (drafter, K); the figures pool them (engine.stats definitions)."""

    generations: int = 0
    new_tokens: int = 0
    decode_tokens: int = 0            # after each prompt's first token, as decode tokens per second counts them
    target_passes: int = 0
    drafted: int = 0
    accepted: int = 0
    decode_seconds: float = 0.0
    identical: bool = True            # every output equals plain greedy decoding
    taus: list[float] = field(default_factory=list)
    cost_ratios: list[float] = field(default_factory=list)   # engine-measured c = drafter pass / target pass

    def add(self, stats, identical: bool) -> None:
        self.generations += 1
        self.new_tokens += stats.new_tokens
        self.decode_tokens += max(0, stats.new_tokens - 1)
        self.target_passes += stats.target_passes
        self.drafted += stats.drafted_tokens
        self.accepted += stats.accepted_tokens
        self.decode_seconds += stats.wall_time - stats.time_to_first_token
        self.identical &= identical
        self.taus.append(stats.tau)
        self.cost_ratios.append(stats.draft_cost_ratio)

    def summary(self, plain_seconds: float) -> dict:
        return {'tau': round(tau(self.new_tokens, self.target_passes, self.generations), 3),
                'tau_per_prompt': [round(value, 2) for value in self.taus],
                'acceptance': round(acceptance_rate(self.accepted, self.drafted), 3),   # NaN: plain decoding
                'tokens_per_s': round(tokens_per_second(self.decode_tokens, self.decode_seconds), 1),
                'speedup': round(plain_seconds / self.decode_seconds, 3) if self.decode_seconds else 0.0,
                'draft_cost_ratio': round(statistics.fmean(self.cost_ratios), 3),
                'identical_to_plain': self.identical}


def chunk_at_line(text: str, rng: random.Random, num_chars: int) -> str:
    """num_chars of text starting at a random line start."""
    starts = [0] + [m.end() for m in re.finditer('\n', text[:max(1, len(text) - num_chars)])]
    start = rng.choice(starts)
    return text[start:start + num_chars]


def held_out_prompts(per_category: int, prompt_chars: int, seed: int) -> list[Prompt]:
    """Prompts from files never seen in training, in the four categories."""
    rng = random.Random(seed)
    docs = list(corpus.default_documents('heldout'))
    code = [d for d in docs if d.kind == 'code' and len(d.text) > 4 * prompt_chars]
    prose = [d for d in docs if d.kind == 'prose' and len(d.text) > 2 * prompt_chars]
    if not code or not prose:
        raise ValueError('the held-out corpus has too few long documents for evaluation prompts')
    prompts = []
    for doc in rng.sample(code, min(per_category, len(code))):
        prompts.append(Prompt('code', doc.source, chunk_at_line(doc.text, rng, prompt_chars)))
    docstring_sites = [(d, m.end()) for d in code for m in re.finditer(r'\n    def [^\n]+:\n        """', d.text)]
    for doc, end in rng.sample(docstring_sites, min(per_category, len(docstring_sites))):
        prompts.append(Prompt('docstring', doc.source, doc.text[max(0, end - prompt_chars):end]))
    for doc in rng.sample(code, min(per_category, len(code))):
        # a block of code followed by the start of its verbatim repeat: continuing means copying
        block = chunk_at_line(doc.text, rng, prompt_chars // 2)
        prompts.append(Prompt('extraction', doc.source, block + '\n\n# The same code, copied verbatim:\n' +
                              block[:len(block) // 4]))
    for doc in rng.sample(prose, min(per_category, len(prose))):
        prompts.append(Prompt('free_text', doc.source, chunk_at_line(doc.text, rng, prompt_chars)))
    return prompts


def evaluate_drafters(engine, prompts: list[Prompt], drafters: list[str], ks: list[int], max_new_tokens: int,
                      progress=print) -> dict:
    """Greedy generations per prompt: plain once, then each drafter at each K; figures per category."""
    from gemma_spec_ros.engine import GenerationRequest

    figures: dict[tuple[str, str, int], RunFigures] = {}
    for index, prompt in enumerate(prompts):
        ids = engine.tokenizer(prompt.text).input_ids

        def run(drafter: str, k: int, ids=ids):
            return engine.generate(GenerationRequest(prompt_ids=ids, max_new_tokens=max_new_tokens,
                                                     temperature=0.0, drafter=drafter, num_draft_tokens=k))
        engine.generate(GenerationRequest(prompt_ids=ids, max_new_tokens=4, drafter='none'))  # warm caches
        plain = run('none', 0)
        figures.setdefault((prompt.category, 'none', 0), RunFigures()).add(plain.stats, True)
        for drafter in drafters:
            for k in ks:
                result = run(drafter, k)
                if result.stats.drafter != drafter:
                    raise ValueError(f'drafter {drafter} fell back to plain decoding: {result.warnings}')
                figures.setdefault((prompt.category, drafter, k), RunFigures()).add(
                    result.stats, result.token_ids == plain.token_ids)
        progress(f'[{index + 1}/{len(prompts)}] {prompt.category}: {prompt.source}')
    table: dict = {}
    for (category, drafter, k), run_figures in figures.items():
        plain_seconds = figures[(category, 'none', 0)].decode_seconds
        table.setdefault(category, {}).setdefault(drafter, {})[str(k)] = run_figures.summary(plain_seconds)
    return table


def format_cell(cell: dict) -> str:
    mark = '' if cell['identical_to_plain'] else ' (differs from plain!)'
    figures = (format_figure(cell[key], '{:.2f}') for key in ('tau', 'acceptance'))
    return '{} / {} / {:.2f}x{}'.format(*figures, cell['speedup'], mark)


def markdown_table(table: dict, drafters: list[str], ks: list[int]) -> str:
    """One row per category and drafter: tau / acceptance / speedup at each K."""
    lines = ['| category | drafter | ' + ' | '.join(f'K={k}' for k in ks) + ' |',
             '|---|---|' + '---|' * len(ks)]
    for category in table:
        for drafter in drafters:
            cells = [table[category][drafter][str(k)] for k in ks]
            lines.append(f'| {category} | {drafter} | ' + ' | '.join(map(format_cell, cells)) + ' |')
    return '\n'.join(lines)


def write_report(path, table: dict, prompts: list[Prompt], settings: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, 'w') as out:
        json.dump({'settings': settings, 'prompts': [asdict(p) for p in prompts], 'results': table}, out, indent=1)


# ------------------------------------------------------------------------------------------ continuation quality
CHAT_REQUESTS = ('Say hi.', 'What is a robot?', 'Write a Python function that adds two numbers.',
                 'Describe the kitchen in one sentence.', 'Continue this text:\nThe robot arm has six joints and')


def looping(ids: list[int], n: int = 8, repeats: int = 3) -> bool:
    """Tell whether some n-gram comes back repeats times or more (a greedy loop such as `_from_from_from`)."""
    counts: dict[tuple, int] = {}
    for i in range(len(ids) - n + 1):
        gram = tuple(ids[i:i + n])
        counts[gram] = counts.get(gram, 0) + 1
    return any(count >= repeats for count in counts.values())


def distinct_ratio(ids: list[int], n: int = 4) -> float:
    grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def continuation_report(model, tokenizer, prompts: list[Prompt], max_new_tokens: int = 96) -> dict:
    """
    Report greedy continuations of held-out raw prompts, and chat replies without tools: what a fine-tune must keep.

    Per category: the share that loops, the mean distinct 4-gram ratio and the mean length.
    """
    from gemma_spec_ros.train.lm import greedy_continuation

    def greedy(ids: list[int], stop: list[int]) -> list[int]:
        return greedy_continuation(model, ids, stop, max_new_tokens)

    eos = [tokenizer.eos_token_id]
    by_category: dict[str, list[list[int]]] = {}
    for prompt in prompts:
        ids = [tokenizer.bos_token_id] + tokenizer(prompt.text, add_special_tokens=False)['input_ids']
        by_category.setdefault(prompt.category, []).append(greedy(ids, eos))
    report = {category: {'prompts': len(outs), 'looping': round(sum(map(looping, outs)) / len(outs), 3),
                         'distinct_4grams': round(statistics.fmean(map(distinct_ratio, outs)), 3),
                         'mean_tokens': round(statistics.fmean(map(len, outs)), 1)}
              for category, outs in by_category.items()}
    stop = tokenizer.convert_tokens_to_ids(['<turn|>', '<eos>'])
    chats = []
    for request in CHAT_REQUESTS:
        text = tokenizer.apply_chat_template([{'role': 'user', 'content': request}], tokenize=False,
                                             add_generation_prompt=True)
        reply = greedy(tokenizer(text, add_special_tokens=False)['input_ids'], stop)
        chats.append({'request': request, 'reply': tokenizer.decode(reply, skip_special_tokens=False),
                      'looping': looping(reply), 'calls_a_tool': '<|tool_call>' in tokenizer.decode(reply)})
    report['chat'] = chats
    return report
