"""
The schema corpus: real-world JSON Schemas through the local engine's Python API, as a planner would send them.

``python -m gemma_spec_ros bench --schemas test/data/schemas [--drafters mtp] [--max-new-tokens 256]`` reads the
corpus' manifest.json (each schema's file, source, provenance), and sends every schema as a json_schema goal: a
prompt naming the schema's title, greedy, plain decoding and then every drafter. Each outcome is one of:

- refused: the request was refused, naming the keyword the grammar cannot enforce (or what else is wrong);
- complete and valid: structure_complete, and the output validates (jsonschema, the schema's draft);
- incomplete: the budget ended the output first (or a stop);
- caught: the grammar completed but the output fails the schema, and the final check said so (structure_complete
  false, a SCHEMA_VIOLATION warning): a keyword left to the check with json_schema_unenforced check;
- complete but invalid: structure_complete true, yet the validator (run here again) refuses the output. The goal is
  none.

and per drafter, whether its tokens equal plain decoding's (greedy: they must). With ``--sampled-seeds N``, every
accepted schema is also sampled N times (temperature 1, seeds 0..N-1) with the last drafter: the masks and the
uniqueItems tracker must hold when drafts are rejected and rolled back. Output: results.json and results.md in --out
(default bench/results/<date>-schemas).
"""

import json
import re
import time
from collections import Counter
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import jsonschema

from gemma_spec_ros.benchmarks.harness import Settings, load_engine
from gemma_spec_ros.benchmarks.report import machine_description, write_json
from gemma_spec_ros.engine.types import GenerationRequest, WarningKind

FORMAT = 'gemma_spec_ros.bench.schemas/1'
OUTCOMES = ('complete_valid', 'incomplete', 'caught', 'complete_invalid')
_KEYWORD = re.compile(r"^json_schema: '([^']+)' at ")


@dataclass
class Outcome:
    """One schema with one drafter."""

    schema: str
    source: str
    drafter: str
    outcome: str          # refused, or one of OUTCOMES
    keyword: str = ''     # refused: the keyword the error names ('' when it names none)
    reason: str = ''      # refused: the error; caught: the warning; complete_invalid: the validator's message
    new_tokens: int = 0
    tokens: tuple = ()
    seconds: float = 0.0


def load_corpus(directory: Path) -> list[dict]:
    """Return the manifest's entries, each with its schema text ('text'); ValueError when a file is missing."""
    manifest = json.loads((directory / 'manifest.json').read_text())
    entries = []
    for entry in manifest['schemas']:
        path = directory / entry['file']
        if not path.is_file():
            raise ValueError('--schemas: {} lists {}, which is missing'.format(directory / 'manifest.json', path))
        entries.append(dict(entry, text=path.read_text()))
    return entries


def prompt(entry: dict) -> str:
    """Return the goal's prompt: what the schema describes (its title and description), then 'JSON:'."""
    schema = json.loads(entry['text'])
    title = schema.get('title') if isinstance(schema.get('title'), str) else Path(entry['file']).stem
    description = schema.get('description') if isinstance(schema.get('description'), str) else ''
    return 'Write one JSON value for "{}". {}\nJSON:\n'.format(title, ' '.join(description.split())[:200])


def classify(entry: dict, drafter: str, result, seconds: float) -> Outcome:
    """Return the outcome of one generation; a structure_complete output is validated here again."""
    outcome = Outcome(entry['file'], entry['source'], drafter, 'incomplete', new_tokens=len(result.token_ids),
                      tokens=tuple(result.token_ids), seconds=seconds)
    violations = [w for w in result.warnings if getattr(w, 'kind', None) is WarningKind.SCHEMA_VIOLATION]
    if violations:
        outcome.outcome, outcome.reason = 'caught', str(violations[0])
    elif result.structure_complete:
        schema = json.loads(entry['text'])
        try:
            error = jsonschema.exceptions.best_match(
                jsonschema.validators.validator_for(schema)(schema).iter_errors(json.loads(result.text)))
        except json.JSONDecodeError as exc:
            error = exc
        outcome.outcome = 'complete_valid' if error is None else 'complete_invalid'
        outcome.reason = '' if error is None else 'structure_complete but {}'.format(getattr(error, 'message', error))
    return outcome


def run_schema(engine, entry: dict, drafters: list[str], max_new_tokens: int, unenforced: str,
               sampled_seeds: int = 0) -> list[Outcome]:
    """
    Run one schema greedy with plain decoding and every drafter (or record its refusal once per drafter).

    Then sampled_seeds sampled runs with the last drafter (named '<drafter>@t1'), unless the schema was refused.
    """
    outcomes = []
    runs = [(drafter, 0.0, -1) for drafter in ['none'] + drafters]
    runs += [((['none'] + drafters)[-1], 1.0, seed) for seed in range(sampled_seeds)]
    for drafter, temperature, seed in runs:
        if temperature and outcomes[0].outcome == 'refused':
            break
        request = GenerationRequest(prompt=prompt(entry), json_schema=entry['text'], max_new_tokens=max_new_tokens,
                                    drafter=drafter, json_schema_unenforced=unenforced, temperature=temperature,
                                    seed=seed)
        drafter = f'{drafter}@t1' if temperature else drafter
        started = time.perf_counter()
        try:
            result = engine.generate(request)
        except ValueError as exc:
            match = _KEYWORD.match(str(exc))
            outcomes.append(Outcome(entry['file'], entry['source'], drafter, 'refused',
                                    match.group(1) if match else '', str(exc)[:300]))
            continue
        outcomes.append(classify(entry, drafter, result, time.perf_counter() - started))
    return outcomes


def summarize(outcomes: list[Outcome], drafters: list[str]) -> dict:
    """Return counts per drafter and sampled runs, refusals by keyword and source, greedy parity with plain."""
    plain = {o.schema: o.tokens for o in outcomes if o.drafter == 'none'}
    summary = {}
    sampled = sorted({o.drafter for o in outcomes if o.drafter.endswith('@t1')})
    for drafter in ['none'] + drafters + sampled:
        mine = [o for o in outcomes if o.drafter == drafter]
        counts = Counter(o.outcome for o in mine)
        served = [o for o in mine if o.outcome != 'refused']
        summary[drafter] = {'schemas': len(mine), 'accepted': len(served), 'refused': counts['refused'],
                            **{name: counts[name] for name in OUTCOMES},
                            'identical_to_plain': sum(o.tokens == plain[o.schema] for o in served)
                            if drafter not in sampled else None,
                            'new_tokens': sum(o.new_tokens for o in served),
                            'seconds': round(sum(o.seconds for o in served), 1)}
    first = [o for o in outcomes if o.drafter == 'none']
    refused = [o for o in first if o.outcome == 'refused']
    by_source = {}
    for source in sorted({o.source for o in first}):
        mine = [o for o in first if o.source == source]
        by_source[source] = {'schemas': len(mine), 'refused': sum(o.outcome == 'refused' for o in mine),
                             **{name: sum(o.outcome == name for o in mine) for name in OUTCOMES}}
    return {'drafters': summary, 'refused_keywords': dict(Counter(o.keyword or '(other)' for o in refused)
                                                           .most_common()),
            'by_source': by_source}


def run(settings: Settings, directory: Path, out: Path, command: str, unenforced: str, progress,
        sampled_seeds: int = 0) -> dict:
    """Measure the corpus in directory; write results.json and results.md into out; return the document."""
    started = time.time()
    entries = load_corpus(directory)
    engine = load_engine(settings, progress, settings.compile_modes[0])
    drafters = [name for name in settings.drafters if name != 'none']
    outcomes = []
    for index, entry in enumerate(entries):
        mine = run_schema(engine, entry, drafters, settings.max_new_tokens, unenforced, sampled_seeds)
        outcomes += mine
        plain = mine[0]
        progress('{}/{} {}: {}{}'.format(index + 1, len(entries), entry['file'], plain.outcome,
                                         ' ({})'.format(plain.keyword or plain.reason[:80]) if plain.reason else ''))
    document = {'format': FORMAT, 'command': command, 'date': datetime.now(UTC).isoformat(timespec='seconds'),
                'machine': machine_description(settings.threads), 'settings': asdict(settings),
                'corpus': str(directory), 'json_schema_unenforced': unenforced or 'refuse',
                'sampled_seeds': sampled_seeds,
                'summary': summarize(outcomes, drafters),
                'outcomes': [dict(asdict(o), tokens=None) for o in outcomes],
                'seconds': round(time.time() - started, 1)}
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / 'results.json', document)
    (out / 'results.md').write_text(markdown(document))
    return document


def markdown(document: dict) -> str:
    summary = document['summary']
    lines = ['# JSON Schema corpus ({}, {} schemas, greedy, {} new tokens, json_schema_unenforced {})'.format(
        document['corpus'], summary['drafters']['none']['schemas'], document['settings']['max_new_tokens'],
        document['json_schema_unenforced']), '', '`{}`'.format(document['command']), '',
        '| drafter | accepted | complete and valid | incomplete | refused | caught by the final check | complete but '
        'invalid | tokens = plain |', '|---|---|---|---|---|---|---|---|']
    for name, row in summary['drafters'].items():
        parity = '–' if row['identical_to_plain'] is None else f"{row['identical_to_plain']}/{row['accepted']}"
        lines.append('| {} | {} | {} | {} | {} | {} | {} | {} |'.format(
            name, row['accepted'], row['complete_valid'], row['incomplete'], row['refused'], row['caught'],
            row['complete_invalid'], parity))
    lines += ['', 'Refused, by keyword: ' + (', '.join('{} {}'.format(keyword, count) for keyword, count in
                                                       summary['refused_keywords'].items()) or 'none'), '',
              '| source | schemas | refused | complete and valid | incomplete | caught | complete but invalid |',
              '|---|---|---|---|---|---|---|']
    for source, row in summary['by_source'].items():
        lines.append('| {} | {} | {} | {} | {} | {} | {} |'.format(source, row['schemas'], row['refused'],
                                                                    row['complete_valid'], row['incomplete'],
                                                                    row['caught'], row['complete_invalid']))
    return '\n'.join(lines) + '\n'
