"""
``python -m gemma_spec_ros train <command>``: tokenizer, target, draft, assistant, ordered-head, eval-drafter, vision.

Also eval-continuations (do greedy continuations of code, prose and tool-less chat loop).

Also planner-corpus and eval-planner (the robot-task conversations of train/corpora/planner.py).

Training commands share: --seed, a tqdm bar with loss and tokens/s, safetensors checkpoints in --run-dir
every --checkpoint-every steps, --resume, --max-minutes, and a from_pretrained-loadable --out directory
with the tokenizer and a training.json report.
"""

import argparse
import contextlib
import json
import random
import sys
import time
from pathlib import Path

import torch

from gemma_spec_ros.train.corpora import corpus, planner
from gemma_spec_ros.train.corpora.data import TokenStream
from gemma_spec_ros.train.export import save_model, storage_dtype
from gemma_spec_ros.train.lm import (
    ArgumentWeight,
    BatchSettings,
    distill_step,
    init_for_scratch_training,
    lm_step,
    perplexity,
)
from gemma_spec_ros.train.loop import LoopResult, LoopSettings, train_loop
from gemma_spec_ros.train.shapes import ModelShape, assistant_config, parameter_count, text_config


# ------------------------------------------------------------------------------------------------ shared setup
def common_setup(args: argparse.Namespace) -> torch.device:
    """Seed, threads and device from the shared options."""
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device not in ('auto', 'cpu', 'cuda'):
        raise ValueError(f"--device must be auto, cpu or cuda, got {args.device!r}")
    if args.device == 'cuda' and not torch.cuda.is_available():
        raise ValueError('--device cuda requested but CUDA is not available')
    return torch.device('cuda' if args.device == 'cuda' or (args.device == 'auto' and torch.cuda.is_available())
                        else 'cpu')


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    if not (Path(path) / 'tokenizer.json').exists() and not (Path(path) / 'tokenizer_config.json').exists():
        raise ValueError(f'no tokenizer found in {path}')
    return AutoTokenizer.from_pretrained(path)


def load_frozen(path: str, device: torch.device, what: str):
    """Load a frozen causal LM (Gemma4ForCausalLM or Gemma4ForConditionalGeneration): bf16 on CUDA, else fp32."""
    from transformers import AutoModelForCausalLM

    if not (Path(path) / 'config.json').exists():
        raise ValueError(f'{what} directory {path} has no config.json')
    dtype = torch.bfloat16 if device.type == 'cuda' else torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    model.requires_grad_(False)
    return model


def streams(args: argparse.Namespace, tokenizer) -> tuple[TokenStream, dict[str, TokenStream]]:
    """Training stream and held-out streams by kind: --input / --eval-input, else the default corpus split."""
    if args.input:
        train_docs = corpus.load_documents(args.input, 'all')
        held_docs = corpus.load_documents(args.eval_input, 'all') if args.eval_input else []
    else:
        train_docs = corpus.load_documents(None, 'train')
        held_docs = corpus.load_documents(args.eval_input, 'all') if args.eval_input else \
            corpus.load_documents(None, 'heldout')
    extra = corpus.load_documents(args.extra_input, 'all') if getattr(args, 'extra_input', None) else []
    train_docs = train_docs + extra
    train = TokenStream.from_documents(tokenizer, train_docs)
    held = {kind: TokenStream.from_documents(tokenizer, [d for d in held_docs if d.kind == kind])
            for kind in sorted({d.kind for d in held_docs})}
    if extra:
        extra_tokens = sum(len(ids) + 2 for ids in tokenizer([d.text for d in extra], add_special_tokens=False)[
            'input_ids'])
        print(f'--extra-input: {len(extra)} documents, {extra_tokens / 1e6:.2f} M tokens '
              f'({100 * extra_tokens / len(train):.0f} % of the training tokens)')
    print(f'corpus: {len(train_docs)} training documents ({len(train) / 1e6:.2f} M tokens); held out: ' +
          (', '.join(f'{kind} {len(s) / 1e3:.0f} k tokens' for kind, s in held.items()) or 'none'))
    return train, held


def loop_settings(args: argparse.Namespace) -> LoopSettings:
    return LoopSettings(steps=args.steps, learning_rate=args.lr, run_dir=Path(args.run_dir),
                        warmup_steps=min(args.warmup, args.steps), checkpoint_every=args.checkpoint_every,
                        max_minutes=args.max_minutes, resume=args.resume)


def held_out_perplexity(model, held: dict[str, TokenStream], args, device) -> dict[str, float]:
    return {kind: round(perplexity(model, stream, args.seq_len + 1, args.eval_windows, device), 3)
            for kind, stream in held.items() if len(stream) > args.seq_len + 1}


def cached_greedy_windows(cache: Path, args: argparse.Namespace, target, train: TokenStream, device) -> torch.Tensor:
    """--greedy-windows greedy windows of the target: reused from cache when it was made the same way, else saved."""
    from gemma_spec_ros.train.assistant import greedy_windows

    made_by = {'target': str(Path(args.target).resolve()), 'seed': args.seed, 'prompt_len': args.greedy_prompt_len}
    saved = torch.load(cache) if cache.exists() else None
    if saved is not None and saved['made_by'] == made_by and len(saved['windows']) >= args.greedy_windows \
            and saved['windows'].shape[1] >= args.seq_len:
        print(f'greedy windows: {args.greedy_windows} of the {len(saved["windows"])} in {cache}')
        return saved['windows'][:args.greedy_windows, :args.seq_len]
    windows = greedy_windows(target, train, args.greedy_windows, args.greedy_prompt_len, args.seq_len, args.seed,
                             device)
    cache.parent.mkdir(parents=True, exist_ok=True)
    torch.save({'made_by': made_by, 'windows': windows}, cache)
    return windows


def load_initial(model_class, path: str, device: torch.device, what: str):
    """--init: a saved model to go on training (float32), instead of a fresh one of --shape."""
    if not (Path(path) / 'config.json').exists():
        raise ValueError(f'--init {path} has no config.json')
    print(f'{what}: initialised from {path}')
    return model_class.from_pretrained(path, dtype=torch.float32).to(device)


def initial_report(path: str | None) -> dict:
    """Keep the --init model's training.json under initialised_from in the new one."""
    report = Path(path) / 'training.json' if path else None
    return {'initialised_from': {'path': path, **json.loads(report.read_text())}} if report and report.exists() \
        else ({'initialised_from': {'path': path}} if path else {})


def training_report(args: argparse.Namespace, result: LoopResult, **extra) -> dict:
    argv = sys.argv[2:] if args.argv is None else args.argv
    return {'command': 'python -m gemma_spec_ros train ' + ' '.join(argv), 'steps': result.steps_done,
            'tokens': result.tokens_seen, 'wall_minutes': round(result.wall_seconds / 60, 1),
            'final_loss': round(result.last_loss, 4), **extra}


# ---------------------------------------------------------------------------------------------------- commands
def tokenizer_command(args: argparse.Namespace) -> int:
    from gemma_spec_ros.train.tokenizer import bytes_per_token, save_tokenizer, train_tokenizer

    random.seed(args.seed)
    start = time.time()
    train_docs = corpus.load_documents(args.input, 'all' if args.input else 'train')
    print(f'training on {len(train_docs)} documents, {sum(len(d.text) for d in train_docs) / 1e6:.1f} M chars')
    tokenizer = train_tokenizer((d.text for d in train_docs), args.vocab_size)
    save_tokenizer(tokenizer, Path(args.out))
    if not args.input:
        for kind in ('code', 'prose'):
            held_out = [d.text for d in corpus.default_documents('heldout') if d.kind == kind]
            print(f'held-out {kind}: {bytes_per_token(tokenizer, held_out):.2f} bytes/token')
    print(f'saved {len(tokenizer)} tokens to {args.out} in {time.time() - start:.1f} s')
    return 0


def target_command(args: argparse.Namespace) -> int:
    from transformers import Gemma4ForCausalLM

    device = common_setup(args)
    tokenizer = load_tokenizer(args.tokenizer)
    weight = ArgumentWeight.parse(args.argument_weight, tokenizer) if args.argument_weight else None
    shape = ModelShape.parse(args.shape, sliding_window=args.sliding_window)
    train, held = streams(args, tokenizer)
    before = {}
    if args.init:
        model = load_initial(Gemma4ForCausalLM, args.init, device, 'target')
        config = model.config
        shape_text = f'{config.num_hidden_layers}x{config.hidden_size}x{config.intermediate_size}'
        before = {'held_out_perplexity_before': held_out_perplexity(model, held, args, device)}
        print(f"held-out perplexity of {args.init} (windows of {args.seq_len}): {before['held_out_perplexity_before']}")
    else:
        model = Gemma4ForCausalLM(text_config(shape, len(tokenizer))).to(device)
        init_for_scratch_training(model.model)
        shape_text = args.shape
    print(f'target {shape_text}: {parameter_count(model) / 1e6:.2f} M parameters')
    batch = BatchSettings(args.batch_size, args.seq_len, args.seed)
    result = train_loop(model, lm_step(model, train, batch, device, weight), loop_settings(args), 'target')
    ppl = held_out_perplexity(model, held, args, device)
    print(f'held-out perplexity: {ppl}')
    report = training_report(args, result, shape=shape_text, parameters=parameter_count(model),
                             held_out_perplexity=ppl, **before, **initial_report(args.init))
    save_model(model, Path(args.out), Path(args.tokenizer), storage_dtype(args.storage_dtype), report)
    print(f'saved {args.out}')
    return 0


def draft_command(args: argparse.Namespace) -> int:
    from transformers import Gemma4ForCausalLM

    device = common_setup(args)
    tokenizer = load_tokenizer(args.target)
    teacher = load_frozen(args.target, device, 'target')
    teacher_config = teacher.config.get_text_config()
    shape = ModelShape.parse(args.shape, sliding_window=teacher_config.sliding_window)
    train, held = streams(args, tokenizer)
    if args.init:
        model = load_initial(Gemma4ForCausalLM, args.init, device, 'draft')
        if model.config.vocab_size != teacher_config.vocab_size:
            raise ValueError(f'--init {args.init} has another vocabulary than the target')
        config = model.config
        shape_text = f'{config.num_hidden_layers}x{config.hidden_size}x{config.intermediate_size}'
    else:
        model = Gemma4ForCausalLM(text_config(shape, teacher_config.vocab_size)).to(device)
        init_for_scratch_training(model.model)
        shape_text = args.shape
    print(f'draft {shape_text}: {parameter_count(model) / 1e6:.2f} M parameters')
    batch = BatchSettings(args.batch_size, args.seq_len, args.seed)
    result = train_loop(model, distill_step(model, teacher, train, batch, device), loop_settings(args), 'draft')
    ppl = held_out_perplexity(model, held, args, device)
    print(f'held-out perplexity: {ppl}')
    report = training_report(args, result, shape=shape_text, parameters=parameter_count(model),
                             held_out_perplexity=ppl, target=args.target, **initial_report(args.init))
    save_model(model, Path(args.out), Path(args.target), storage_dtype(args.storage_dtype), report)
    print(f'saved {args.out}')
    return 0


def assistant_command(args: argparse.Namespace) -> int:
    from transformers import Gemma4AssistantForCausalLM

    from gemma_spec_ros.train.assistant import DraftSteps, assistant_step, draft_accuracy

    device = common_setup(args)
    tokenizer = load_tokenizer(args.target)
    target = load_frozen(args.target, device, 'target')
    if args.init:
        assistant = Gemma4AssistantForCausalLM.from_pretrained(args.init, dtype=torch.float32)
    else:
        assistant = Gemma4AssistantForCausalLM(assistant_config(target.config.get_text_config(),
                                                                ModelShape.parse(args.shape)))
        init_for_scratch_training(assistant.model)
    if assistant.config.use_ordered_embeddings:
        print(f'note: {args.init} has an ordered-embedding head; training changes the states it was fitted to, so '
              'run `train ordered-head` on the result')
    if assistant.config.backbone_hidden_size != target.config.get_text_config().hidden_size:
        raise ValueError('the assistant backbone_hidden_size does not match the target hidden size')
    assistant.to(device)
    steps = DraftSteps(args.draft_steps, args.step_decay)
    train, held = streams(args, tokenizer)
    print(f'assistant: {parameter_count(assistant) / 1e6:.2f} M parameters, {steps.num_steps} draft steps')
    batch = BatchSettings(args.batch_size, args.seq_len, args.seed)
    autocast = torch.autocast('cuda', dtype=torch.bfloat16) if device.type == 'cuda' else contextlib.nullcontext()
    greedy = None
    if args.greedy_windows:
        cache = Path(args.greedy_cache or Path(args.run_dir) / 'greedy_windows.pt')
        greedy = cached_greedy_windows(cache, args, target, train, device)
    step_fn = assistant_step(assistant, target, train, greedy, batch, steps, device)

    def autocast_step(index: int):
        with autocast:
            return step_fn(index)
    result = train_loop(assistant, autocast_step, loop_settings(args), 'assistant')
    accuracy = {}
    for kind, stream in held.items():
        if len(stream) > args.seq_len:
            ids = stream.ids[:len(stream) // args.seq_len * args.seq_len].view(-1, args.seq_len)
            with autocast:
                accuracy[kind] = [round(a, 3) for a in draft_accuracy(
                    assistant, target, ids[:args.eval_windows // 4 or 1].long().to(device), steps)]
    print(f'held-out teacher-forced draft accuracy per step: {accuracy}')
    assistant.generation_config.num_assistant_tokens = args.draft_steps   # transformers' assisted generate needs it
    report = training_report(args, result, shape=args.shape if not args.init else f'init from {args.init}',
                             parameters=parameter_count(assistant), target=args.target,
                             held_out_draft_accuracy=accuracy, greedy_windows=args.greedy_windows,
                             **initial_report(args.init))
    save_model(assistant, Path(args.out), Path(args.target), storage_dtype(args.storage_dtype), report)
    print(f'saved {args.out}')
    return 0


def eagle3_command(args: argparse.Namespace) -> int:
    import shutil

    from gemma_spec_ros.engine.runtime.model.eagle import Eagle3Config, Eagle3Head
    from gemma_spec_ros.train import eagle3

    device = common_setup(args)
    tokenizer = load_tokenizer(args.target)
    target = load_frozen(args.target, device, 'target')
    target_config = target.config.get_text_config()
    if args.init:
        head = Eagle3Head.load(args.init, device, torch.float32).requires_grad_(True)
        head.check_fits(target_config, args.init)
    else:
        layers, hidden, intermediate = (int(part) for part in args.shape.split('x'))
        if layers != 1:
            raise ValueError(f'an EAGLE-3 head has one decoder layer: --shape 1xHIDDENxINTERMEDIATE, got {args.shape}')
        head = eagle3.initial_head(Eagle3Config.for_target(target_config, hidden_size=hidden,
                                                           intermediate_size=intermediate), target)
    head.to(device)
    train, held = streams(args, tokenizer)
    print(f'EAGLE-3 head: {parameter_count(head) / 1e6:.2f} M parameters, target layers '
          f'{head.config.feature_layers} tapped, {args.depth} drafted depths')
    batch = BatchSettings(args.batch_size, args.seq_len, args.seed)
    greedy = None
    if args.greedy_windows:
        greedy = cached_greedy_windows(Path(args.greedy_cache or Path(args.run_dir) / 'greedy_windows.pt'), args,
                                       target, train, device)
    step_fn = eagle3.eagle3_step(head, target, train, greedy, batch, args.depth, args.depth_decay, device)
    result = train_loop(head, step_fn, loop_settings(args), 'eagle3')
    accuracy = {}
    for kind, stream in held.items():
        if len(stream) > args.seq_len:
            ids = stream.ids[:len(stream) // args.seq_len * args.seq_len].view(-1, args.seq_len)
            accuracy[kind] = [round(a, 3) for a in eagle3.draft_accuracy(
                head, target, ids[:args.eval_windows // 4 or 1].long().to(device), args.depth)]
    print(f'held-out teacher-forced draft accuracy per depth: {accuracy}')
    report = training_report(args, result, shape=args.shape if not args.init else f'init from {args.init}',
                             parameters=parameter_count(head), target=args.target, held_out_draft_accuracy=accuracy,
                             greedy_windows=args.greedy_windows, **initial_report(args.init))
    out = Path(args.out)
    head.save(out, storage_dtype(args.storage_dtype))
    (out / 'training.json').write_text(json.dumps(report, indent=1) + '\n')
    for name in ('tokenizer.json', 'tokenizer_config.json', 'chat_template.jinja'):
        if (Path(args.target) / name).exists():
            shutil.copy(Path(args.target) / name, out / name)
    print(f'saved {args.out}')
    return 0


def ordered_head_command(args: argparse.Namespace) -> int:
    import json

    from transformers import Gemma4AssistantForCausalLM
    from transformers.models.gemma4_assistant.modeling_gemma4_assistant import Gemma4AssistantMaskedEmbedder

    from gemma_spec_ros.train import ordered_head as head
    from gemma_spec_ros.train.assistant import DraftSteps, greedy_windows

    started = time.time()
    device = common_setup(args)
    tokenizer = load_tokenizer(args.target)
    target = load_frozen(args.target, device, 'target')
    assistant = Gemma4AssistantForCausalLM.from_pretrained(args.assistant, dtype=torch.float32).to(device).eval()
    assistant.requires_grad_(False)
    embeddings = assistant.lm_head.weight.detach().float().cpu()              # [vocab, hidden]
    shape = head.OrderedHeadShape(args.centroids, args.top_k)
    shape.check(embeddings.shape[0])
    train, held = streams(args, tokenizer)
    windows = cached_greedy_windows(Path(args.greedy_cache), args, target, train, device)
    steps = DraftSteps(args.draft_steps)
    features = head.draft_features(assistant, target, windows.to(device), steps, args.batch_size)
    held_features = {kind: head.draft_features(assistant, target, greedy_windows(
        target, stream, args.held_out_windows, args.greedy_prompt_len, args.seq_len, args.seed + 1, device), steps,
        args.batch_size) for kind, stream in held.items() if len(stream) > args.seq_len}
    print(f'draft states: {len(features.full_argmax)} for fitting, '
          + ', '.join(f'{kind} {len(f.full_argmax)}' for kind, f in held_features.items()) + ' held out')
    generator = torch.Generator().manual_seed(args.seed)
    assignment = head.balanced_clusters(embeddings, shape.num_centroids, args.kmeans_iterations, generator)
    ordering = head.token_ordering(assignment)
    centroids = head.fit_centroids(features, embeddings, assignment, shape.num_centroids, args.epochs, args.lr,
                                   generator)
    held_agreement = {kind: head.agreement(f, head.ordered_drafts(f.states, embeddings, centroids, ordering,
                                                                  shape.top_k))
                      for kind, f in held_features.items()}
    print(f'held-out agreement of the ordered head: {held_agreement}')

    assistant.config.use_ordered_embeddings = True
    assistant.config.num_centroids = shape.num_centroids
    assistant.config.centroid_intermediate_top_k = shape.top_k
    assistant.masked_embedding = Gemma4AssistantMaskedEmbedder(assistant.config).to(device)
    assistant.masked_embedding.centroids.weight.data.copy_(centroids)
    assistant.masked_embedding.token_ordering.copy_(ordering)
    previous = Path(args.assistant) / 'training.json'
    report = json.loads(previous.read_text()) if previous.exists() else {}
    report['ordered_head'] = {
        'command': 'python -m gemma_spec_ros train ' + ' '.join(sys.argv[2:] if args.argv is None else args.argv),
        'num_centroids': shape.num_centroids, 'top_k': shape.top_k,
        'head_rows_read': shape.rows_read(embeddings.shape[0]), 'vocab_size': embeddings.shape[0],
        'greedy_windows': args.greedy_windows, 'fitting_states': len(features.full_argmax),
        'held_out_windows_per_kind': args.held_out_windows, 'held_out_agreement': held_agreement,
        'wall_minutes': round((time.time() - started) / 60, 1)}
    save_model(assistant, Path(args.out), Path(args.target), storage_dtype(args.storage_dtype), report)
    print(f'saved {args.out} ({shape.rows_read(embeddings.shape[0])} of {embeddings.shape[0]} head rows per step)')
    return 0


def eval_drafter_command(args: argparse.Namespace) -> int:
    from gemma_spec_ros.engine import Engine, EngineConfig
    from gemma_spec_ros.train.evaluate import evaluate_drafters, held_out_prompts, markdown_table, write_report

    torch.manual_seed(args.seed)
    ks = list(range(1, args.max_k + 1))
    if not 1 <= args.max_k <= 8:
        raise ValueError(f'--max-k must be in 1..8, got {args.max_k}')
    drafters = args.drafters
    config = EngineConfig(target_path=args.target, assistant_path=args.assistant if 'mtp' in drafters else '',
                          draft_model_path=args.draft if 'draft' in drafters else '',
                          eagle3_path=args.eagle3 if 'eagle3' in drafters else '', drafter='none',
                          device=args.device, profit_gate=False, max_draft_tokens=max(ks),
                          num_threads=args.threads, warmup='blocking')  # measured at full speed
    engine = Engine.from_config(config, progress=print)
    prompts = held_out_prompts(args.prompts_per_category, args.prompt_chars, args.seed)
    start = time.time()
    table = evaluate_drafters(engine, prompts, drafters, ks, args.max_new_tokens)
    print(markdown_table(table, drafters, ks))
    print('cells: tau (tokens per target pass, incl. the bonus token) / acceptance / wall-clock speedup vs plain')
    settings = {key: value for key, value in vars(args).items() if key not in ('run', 'argv')}
    settings['wall_minutes'] = round((time.time() - start) / 60, 1)
    write_report(args.out, table, prompts, settings)
    print(f'wrote {args.out}')
    return 0


def eval_continuations_command(args: argparse.Namespace) -> int:
    from gemma_spec_ros.train.evaluate import continuation_report, held_out_prompts

    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = [p for p in held_out_prompts(args.prompts_per_category, args.prompt_chars, args.seed)
               if p.category != 'extraction']   # copying loops by design
    reports = {}
    for path in args.targets:
        tokenizer = load_tokenizer(path)
        reports[path] = continuation_report(load_frozen(path, torch.device('cpu'), 'target'), tokenizer, prompts,
                                            args.max_new_tokens)
        figures = ', '.join(f"{kind} {r['looping']:.0%} looping / {r['distinct_4grams']:.2f} distinct"
                            for kind, r in reports[path].items() if kind != 'chat')
        print(f'{path}: {figures}')
        for chat in reports[path]['chat']:
            print(f"  chat {chat['request']!r} -> {chat['reply'][:100]!r}{' (loops)' if chat['looping'] else ''}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(reports, indent=1) + '\n')
        print(f'wrote {args.out}')
    return 0


def vision_command(args: argparse.Namespace) -> int:
    from gemma_spec_ros.train import vision

    device = common_setup(args)
    if device.type != 'cpu':
        raise ValueError('train vision runs on the CPU (the bundled target is small); pass --device cpu')
    out = Path(args.out)
    shape = vision.VisionShape.parse(args.shape)
    tokenizer = vision.multimodal_tokenizer(Path(args.tokenizer), out)
    config = vision.multimodal_config(Path(args.target), shape, tokenizer)
    model = vision.build_model(Path(args.target), config, args.output_scale)
    if args.init:   # a trained tower and embedder, adapted to a changed target instead of trained anew
        vision.load_tower(model, Path(args.init))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f'vision tower {args.shape} + embedder: {trainable / 1e6:.2f} M trainable parameters (target frozen)')
    encoder = vision.SceneEncoder(tokenizer, shape.image_processor())
    step = vision.vision_step(model, encoder, args.batch_size, args.seed, tuple(args.kinds))
    result = train_loop(model, step, loop_settings(args), 'vision',
                        lr_multipliers={'model.embed_vision.': args.embedder_lr_multiplier})
    start = time.time()
    held = vision.held_out_accuracy(model, encoder, args.eval_scenes)
    print(f'held-out exact match ({args.eval_scenes} scenes, {time.time() - start:.0f} s): {held.exact_match}')
    report = training_report(args, result, shape=args.shape, trainable_parameters=trainable,
                             target=args.target, held_out_scenes=args.eval_scenes,
                             held_out_exact_match=held.exact_match, held_out_examples=held.examples)
    vision.save_vision_model(model, out, Path(args.target), report)
    vision.write_processor_config(out, shape, image_seq_length=encoder.image_processor.max_soft_tokens)
    print(f'saved {out}')
    return 0


def planner_corpus_command(args: argparse.Namespace) -> int:

    start = time.time()
    tokenizer = load_tokenizer(args.tokenizer)
    texts = [d.text for d in corpus.load_documents(None, 'train')] if args.chat_share else None
    weights = planner.parse_kind_weights(args.kind_weights)
    if not 0 <= args.novel_share <= 1:
        raise ValueError(f'--novel-share must be within 0 and 1, got {args.novel_share}')
    chars = planner.write_corpus(Path(args.out), args.conversations, args.seed, tokenizer, args.chat_share, texts,
                                 weights, args.novel_share, args.requests, args.fresh_scenes)
    print(f'wrote {args.conversations} robot-task conversations ({chars / 1e6:.1f} M chars) to {args.out} '
          f'in {time.time() - start:.1f} s')
    return 0


def eval_planner_command(args: argparse.Namespace) -> int:

    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.time()
    tokenizer = load_tokenizer(args.target)
    model = load_frozen(args.target, torch.device('cpu'), 'target')
    report = planner.evaluate_planner(model, tokenizer, args.conversations, args.max_calls, progress=print)
    result = {**report.as_dict(), 'wall_minutes': round((time.time() - start) / 60, 1),
              'command': 'python -m gemma_spec_ros train ' + ' '.join(sys.argv[2:] if args.argv is None
                                                                      else args.argv)}
    print(f'held-out planner ({report.conversations} conversations, {report.calls} calls): exact call sequences '
          f'{report.exact_sequences:.1%}, schema-valid calls {report.valid_calls:.1%}, exact final answers '
          f'{report.exact_answers:.1%}; expected calls made in place {report.right_calls:.1%}, right first calls '
          f'{report.first_calls_right:.1%}; exact by group: ' + ', '.join(
              f'{name} {share:.1%} of {n}' for name, (n, share) in report.by_group.items()))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + '\n')
        print(f'wrote {args.out}')
    if args.write:
        path = Path(args.target) / 'training.json'
        training = json.loads(path.read_text()) if path.exists() else {}
        training['held_out_planner'] = result
        path.write_text(json.dumps(training, indent=2) + '\n')
        print(f'wrote held_out_planner into {path}')
    return 0


# ------------------------------------------------------------------------------------------------------ parser
def add_corpus_args(parser: argparse.ArgumentParser, extra: bool = True) -> None:
    parser.add_argument('--input', nargs='+', metavar='PATH',
                        help='training text: files, directories or .jsonl ({"text": ...} per line); '
                             'default: Python stdlib sources + English docs on this machine (held-out files excluded)')
    if extra:
        parser.add_argument('--extra-input', nargs='+', metavar='PATH',
                            help='more training text (same formats) added to --input or the default corpus, e.g. '
                                 'the robot-task conversations of `train planner-corpus`')
    parser.add_argument('--seed', type=int, default=0, help='random seed')


def add_training_args(parser: argparse.ArgumentParser, out: str, run_dir: str, steps: int, lr: float) -> None:
    parser.add_argument('--eval-input', nargs='+', metavar='PATH', help='held-out text for evaluation')
    parser.add_argument('--out', default=out, help='output model directory (from_pretrained-loadable)')
    parser.add_argument('--run-dir', default=run_dir, help='checkpoints and optimizer state (not for git)')
    parser.add_argument('--resume', action='store_true', help='continue from the checkpoint in --run-dir')
    parser.add_argument('--steps', type=int, default=steps, help='optimizer steps (sets the schedule)')
    parser.add_argument('--max-minutes', type=float, default=0.0, help='stop early after this wall time; 0 = off')
    parser.add_argument('--batch-size', type=int, default=8)
    parser.add_argument('--seq-len', type=int, default=256)
    parser.add_argument('--lr', type=float, default=lr, help='peak learning rate (AdamW, warmup + cosine)')
    parser.add_argument('--warmup', type=int, default=60, help='warmup steps')
    parser.add_argument('--checkpoint-every', type=int, default=100, help='steps between checkpoints')
    parser.add_argument('--eval-windows', type=int, default=64, help='held-out windows for evaluation')
    parser.add_argument('--storage-dtype', default='float16', help='dtype of the saved weights')
    parser.add_argument('--device', default='auto', help='auto|cpu|cuda')
    parser.add_argument('--threads', type=int, default=0, help='torch CPU threads; 0 = default')


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog='python -m gemma_spec_ros train', description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest='command', required=True)

    tok = commands.add_parser('tokenizer', help='train the byte-level BPE tokenizer')
    add_corpus_args(tok, extra=False)
    tok.add_argument('--vocab-size', type=int, default=4096, help='vocabulary size incl. special tokens')
    tok.add_argument('--out', default='models/tokenizer', help='output directory')
    tok.set_defaults(run=tokenizer_command)

    target = commands.add_parser('target', help='train the target Gemma4ForCausalLM from scratch (or fine-tune one)')
    add_corpus_args(target)
    add_training_args(target, out='models/gemma4-spec-target', run_dir='runs/target', steps=1000, lr=2e-3)
    target.add_argument('--tokenizer', default='models/tokenizer', help='tokenizer directory')
    target.add_argument('--shape', default='12x192x768', help='LAYERSxHIDDENxINTERMEDIATE')
    target.add_argument('--sliding-window', type=int, default=128, help='sliding attention window')
    target.add_argument('--init', help='fine-tune an existing target directory instead of building --shape')
    target.add_argument('--argument-weight', default='', metavar='NAME.KEY=W',
                        help="loss weight W on the value of call NAME's first argument KEY (e.g. navigate_to.place=8: "
                             'where a planner drives first)')
    target.set_defaults(run=target_command)

    draft = commands.add_parser('draft', help='distill a smaller Gemma4ForCausalLM draft model from a target')
    add_corpus_args(draft)
    add_training_args(draft, out='models/gemma4-spec-draft', run_dir='runs/draft', steps=600, lr=2e-3)
    draft.add_argument('--target', default='models/gemma4-spec-target', help='teacher (target) model directory')
    draft.add_argument('--shape', default='2x192x768', help='LAYERSxHIDDENxINTERMEDIATE')
    draft.add_argument('--init', help='go on training an existing draft directory instead of building --shape')
    draft.set_defaults(run=draft_command)

    assistant = commands.add_parser('assistant', help='train a Gemma4AssistantForCausalLM (MTP) for a target')
    add_corpus_args(assistant)
    add_training_args(assistant, out='models/gemma4-spec-assistant', run_dir='runs/assistant', steps=600, lr=2e-3)
    assistant.add_argument('--target', default='models/gemma4-spec-target',
                           help='any Gemma 4 target directory (Gemma4ForCausalLM or Gemma4ForConditionalGeneration)')
    assistant.add_argument('--shape', default='1x256x1024', help='assistant LAYERSxHIDDENxINTERMEDIATE')
    assistant.add_argument('--init', help='start from an existing assistant directory instead of --shape')
    assistant.add_argument('--draft-steps', type=int, default=4, help='draft steps unrolled in training')
    assistant.add_argument('--step-decay', type=float, default=0.8, help='loss weight decay per draft step')
    assistant.add_argument('--greedy-windows', type=int, default=256,
                           help='windows of target greedy continuations mixed into training (half of each batch)')
    assistant.add_argument('--greedy-prompt-len', type=int, default=32, help='corpus prompt tokens per greedy window')
    assistant.add_argument('--greedy-cache', default='',
                           help='greedy windows file, reused when it holds enough windows (default: RUN_DIR/'
                                'greedy_windows.pt)')
    assistant.set_defaults(run=assistant_command)

    head = commands.add_parser('eagle3', help='train an EAGLE-3 draft head (one layer on three target states)')
    add_corpus_args(head)
    add_training_args(head, out='models/gemma4-spec-eagle3', run_dir='runs/eagle3', steps=600, lr=2e-3)
    head.add_argument('--target', default='models/gemma4-spec-target', help='any Gemma 4 target directory')
    head.add_argument('--shape', default='1x192x2048', help='1xHIDDENxINTERMEDIATE (the head has one layer)')
    head.add_argument('--init', help='go on training an existing head directory instead of building --shape')
    head.add_argument('--depth', type=int, default=4, help='drafted depths trained at once (training-time test)')
    head.add_argument('--depth-decay', type=float, default=0.8, help='loss weight decay per depth')
    head.add_argument('--greedy-windows', type=int, default=256,
                      help='windows of target greedy continuations mixed into training (half of each batch)')
    head.add_argument('--greedy-prompt-len', type=int, default=32, help='corpus prompt tokens per greedy window')
    head.add_argument('--greedy-cache', default='', help='greedy windows file (as for train assistant)')
    head.set_defaults(run=eagle3_command)

    ordered = commands.add_parser('ordered-head', help="fit the MTP assistant's ordered-embedding (centroid) head")
    add_corpus_args(ordered)
    ordered.add_argument('--target', default='models/gemma4-spec-target')
    ordered.add_argument('--assistant', default='models/gemma4-spec-assistant', help='assistant to add the head to')
    ordered.add_argument('--out', default='models/gemma4-spec-assistant', help='output assistant directory')
    ordered.add_argument('--eval-input', nargs='+', metavar='PATH', help='held-out text for evaluation')
    ordered.add_argument('--centroids', type=int, default=128, help='token clusters (divides the vocabulary)')
    ordered.add_argument('--top-k', type=int, default=16, help='clusters whose tokens get exact logits per step')
    ordered.add_argument('--greedy-windows', type=int, default=256, help='target greedy windows to fit on')
    ordered.add_argument('--greedy-cache', default='runs/ordered-head/greedy_windows.pt',
                         help='greedy windows file, reused when it holds enough windows')
    ordered.add_argument('--greedy-prompt-len', type=int, default=32)
    ordered.add_argument('--held-out-windows', type=int, default=24, help='held-out greedy windows per kind')
    ordered.add_argument('--seq-len', type=int, default=256)
    ordered.add_argument('--draft-steps', type=int, default=4, help='draft steps whose states are fitted')
    ordered.add_argument('--batch-size', type=int, default=8, help='windows per target pass')
    ordered.add_argument('--kmeans-iterations', type=int, default=8)
    ordered.add_argument('--epochs', type=int, default=20, help='passes of centroid training over the states')
    ordered.add_argument('--lr', type=float, default=1e-2, help='centroid learning rate (Adam)')
    ordered.add_argument('--storage-dtype', default='float16', help='dtype of the saved weights')
    ordered.add_argument('--device', default='auto', help='auto|cpu|cuda')
    ordered.add_argument('--threads', type=int, default=0, help='torch CPU threads; 0 = default')
    ordered.set_defaults(run=ordered_head_command)

    evaluate = commands.add_parser('eval-drafter', help='held-out tau, acceptance and speedup at K=1..8 (greedy)')
    evaluate.add_argument('--target', default='models/gemma4-spec-target')
    evaluate.add_argument('--assistant', default='models/gemma4-spec-assistant')
    evaluate.add_argument('--draft', default='models/gemma4-spec-draft')
    evaluate.add_argument('--eagle3', default='models/gemma4-spec-eagle3', help='EAGLE-3 head (drafter eagle3)')
    evaluate.add_argument('--drafters', nargs='+', default=['mtp', 'draft', 'ngram'],
                          choices=['mtp', 'draft', 'ngram', 'eagle3'])
    evaluate.add_argument('--max-k', type=int, default=8, help='evaluate K = 1..max-k')
    evaluate.add_argument('--prompts-per-category', type=int, default=3)
    evaluate.add_argument('--prompt-chars', type=int, default=600, help='prompt length in characters')
    evaluate.add_argument('--max-new-tokens', type=int, default=96)
    evaluate.add_argument('--out', default='runs/eval-drafter.json', help='JSON report')
    evaluate.add_argument('--device', default='auto', help='auto|cpu|cuda')
    evaluate.add_argument('--threads', type=int, default=0, help='torch CPU threads; 0 = default')
    evaluate.add_argument('--seed', type=int, default=0, help='prompt sampling seed')
    evaluate.set_defaults(run=eval_drafter_command)

    cont = commands.add_parser('eval-continuations',
                               help='greedy continuations of held-out code and prose, and chat replies without tools:'
                                    ' do they loop (what a fine-tune must keep)')
    cont.add_argument('targets', nargs='+', help='target model directories to compare')
    cont.add_argument('--prompts-per-category', type=int, default=8)
    cont.add_argument('--prompt-chars', type=int, default=600, help='prompt length in characters')
    cont.add_argument('--max-new-tokens', type=int, default=96)
    cont.add_argument('--out', default='', help='JSON report (optional)')
    cont.add_argument('--threads', type=int, default=0, help='torch CPU threads; 0 = default')
    cont.add_argument('--seed', type=int, default=0, help='prompt sampling seed')
    cont.set_defaults(run=eval_continuations_command)

    vis = commands.add_parser('vision', help='train a vision tower + embedder on the frozen target (synthetic scenes)')
    vis.add_argument('--target', default='models/gemma4-spec-target', help='the frozen text model')
    vis.add_argument('--tokenizer', default='models/tokenizer', help='tokenizer to copy with image tokens added')
    vis.add_argument('--shape', default='2x128x512', help='vision tower LAYERSxHIDDENxINTERMEDIATE')
    vis.add_argument('--out', default='models/gemma4-spec-vision', help='output directory')
    vis.add_argument('--run-dir', default='runs/vision', help='checkpoints and optimizer state (not for git)')
    vis.add_argument('--resume', action='store_true', help='continue from the checkpoint in --run-dir')
    vis.add_argument('--init', help='start from this vision model directory\'s tower and embedder (e.g. after the '
                     'target was fine-tuned)')
    vis.add_argument('--steps', type=int, default=600, help='optimizer steps (sets the schedule)')
    vis.add_argument('--max-minutes', type=float, default=0.0, help='stop early after this wall time; 0 = off')
    vis.add_argument('--batch-size', type=int, default=2, help='scenes per step (every question of each)')
    vis.add_argument('--lr', type=float, default=2e-3, help='peak learning rate (AdamW, warmup + cosine)')
    vis.add_argument('--warmup', type=int, default=30, help='warmup steps')
    vis.add_argument('--checkpoint-every', type=int, default=50, help='steps between checkpoints')
    vis.add_argument('--kinds', nargs='+', default=['objects', 'door', 'where', 'count', 'colour'],
                     help='question kinds to train on (the objects question is the one every scene has)')
    vis.add_argument('--output-scale', type=float, default=10.0,
                     help="initial soft-token RMS, in units of the target's scaled token embeddings' RMS")
    vis.add_argument('--embedder-lr-multiplier', type=float, default=10.0,
                     help="the embedder's learning rate over --lr (its weights start --output-scale times larger)")
    vis.add_argument('--eval-scenes', type=int, default=40, help='held-out scenes (every question of each)')
    vis.add_argument('--device', default='cpu', help='cpu')
    vis.add_argument('--threads', type=int, default=1, help='torch CPU threads; 0 = default')
    vis.add_argument('--seed', type=int, default=0, help='random seed (training scenes)')
    vis.set_defaults(run=vision_command)

    corpus_parser = commands.add_parser('planner-corpus', help='write synthetic robot-task conversations as JSONL')
    corpus_parser.add_argument('--out', default='runs/planner.jsonl', help='JSONL file ({"text": ...} per line)')
    corpus_parser.add_argument('--conversations', type=int, default=6000, help='training conversations to write')
    corpus_parser.add_argument('--tokenizer', default='models/tokenizer', help='tokenizer with the chat template')
    corpus_parser.add_argument('--seed', type=int, default=0, help='random seed')
    corpus_parser.add_argument('--kind-weights', default='', metavar='KIND=W,...',
                               help='request kinds weighted otherwise than the held-out evaluation, e.g. where=3 '
                                    '(more scene look-ups); kinds: ' + ', '.join(planner.KIND_WEIGHTS))
    corpus_parser.add_argument('--novel-share', type=float, default=0.0,
                               help='share of scenes drawn with training-only colours, things and surfaces too (the '
                                    'evaluation never names them): teaches reading the scene over object-place habits')
    corpus_parser.add_argument('--requests', type=int, default=planner.MAX_REQUESTS,
                               help='most requests in one conversation without thinking')
    corpus_parser.add_argument('--fresh-scenes', action='store_true',
                               help='each request in a conversation has a scene of its own, and as many as fit '
                                    'come (more look-ups of where an object stands per training token)')
    corpus_parser.add_argument('--chat-share', type=float, default=0.0,
                               help='share of chat turns without tools (continuations of the default corpus)')
    corpus_parser.set_defaults(run=planner_corpus_command)

    plan = commands.add_parser('eval-planner', help='held-out robot-task planning: exact call sequences (greedy)')
    plan.add_argument('--target', default='models/gemma4-spec-target')
    plan.add_argument('--conversations', type=int, default=40, help='held-out conversations')
    plan.add_argument('--max-calls', type=int, default=8, help='calls per conversation before giving up')
    plan.add_argument('--out', default='', help='JSON report (optional)')
    plan.add_argument('--write', action='store_true', help="put the figures into TARGET/training.json "
                                                           "(held_out_planner)")
    plan.add_argument('--threads', type=int, default=0, help='torch CPU threads; 0 = default')
    plan.add_argument('--seed', type=int, default=0, help='torch seed (generation is greedy)')
    plan.set_defaults(run=eval_planner_command)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    args.argv = argv
    try:
        return args.run(args)
    except ValueError as error:
        print(f'error: {error}', file=sys.stderr)
        return 2
