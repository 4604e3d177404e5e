"""PNG plots of a run (matplotlib, Agg backend: no display needed)."""

from pathlib import Path

from gemma_spec_ros.benchmarks.analysis import ALL, Summary

DRAFTER_COLORS = {'ngram': 'tab:green', 'draft': 'tab:blue', 'mtp': 'tab:red'}


def _pyplot():
    import matplotlib

    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    return plt


def speedup_by_category(summary: Summary, categories: list[str], drafters: list[str], path: Path) -> None:
    """Per drafter: speedup vs transformers' plain generate by category, ours (adaptive, best K) vs transformers."""
    plt = _pyplot()
    groups = [ALL] + categories
    fig, axes = plt.subplots(1, len(drafters), figsize=(5.5 * len(drafters), 4.2), squeeze=False, sharey=True)
    for axis, drafter in zip(axes[0], drafters, strict=True):
        series = _series_for(summary, drafter)
        width = 0.8 / max(1, len(series))
        for index, (label, system_names) in enumerate(series):
            values = []
            for group in groups:
                cells = [summary.cell(name, group) for name in system_names]
                values.append(max((c.speedup_vs_hf_plain for c in cells if c is not None), default=0.0))
            axis.bar([g + index * width for g in range(len(groups))], values, width, label=label)
        ours_plain = [summary.cell(summary.ours_plain, group) for group in groups]
        axis.plot([g + 0.4 - width / 2 for g in range(len(groups))],
                  [c.speedup_vs_hf_plain if c else 0.0 for c in ours_plain], 'k_', markersize=18,
                  label='ours plain')
        axis.axhline(1.0, color='grey', linewidth=0.8)
        axis.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))], groups, rotation=20)
        axis.set_title(drafter)
        axis.legend(fontsize=7)
    axes[0][0].set_ylabel("speedup vs transformers' plain generate")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _ours(summary: Summary) -> str:
    """Return the system prefix of our first compile mode (the one the plots show)."""
    return summary.ours_plain.split('/')[0]


def _series_for(summary: Summary, drafter: str) -> list[tuple[str, list[str]]]:
    names = sorted({c.system for c in summary.cells if c.drafter == drafter})
    ours = _ours(summary)
    ours_fixed = [n for n in names if n.startswith(ours + '/') and '/K' in n]
    hf_fixed = [n for n in names if n.startswith('hf/') and '/K' in n]
    series = [('ours adaptive', ['{}/{}/adaptive'.format(ours, drafter)]), ('ours best fixed K', ours_fixed),
              ('transformers default', ['hf/{}/default'.format(drafter)]), ('transformers tuned K', hf_fixed),
              ('transformers static tuned K', [n for n in names if n.startswith('hf-static/')]),
              ('vLLM', [n for n in names if n.startswith('vllm/')])]
    return [(label, members) for label, members in series if any(m in names for m in members)]


def k_sweep(summary: Summary, drafters: list[str], path: Path) -> None:
    """Our speedup (vs our plain) and tau against fixed K; adaptive drawn at its mean K."""
    plt = _pyplot()
    fig, (speed_axis, tau_axis) = plt.subplots(1, 2, figsize=(10, 4))
    for drafter in drafters:
        fixed = sorted((c for c in summary.cells if c.category == ALL and c.system.startswith(_ours(summary) + '/')
                        and c.drafter == drafter and c.k), key=lambda c: c.k)
        color = DRAFTER_COLORS.get(drafter)
        speed_axis.plot([c.k for c in fixed], [c.speedup_vs_ours_plain for c in fixed], 'o-', color=color,
                        label=drafter)
        tau_axis.plot([c.k for c in fixed], [c.tau for c in fixed], 'o-', color=color, label=drafter)
        if any(c.predicted_tau for c in fixed):
            tau_axis.plot([c.k for c in fixed], [c.predicted_tau or 0.0 for c in fixed], ':', color=color,
                          label=drafter + ' predicted')
        adaptive = summary.cell('{}/{}/adaptive'.format(_ours(summary), drafter))
        if adaptive is not None:
            speed_axis.plot([adaptive.mean_k], [adaptive.speedup_vs_ours_plain], '*', color=color, markersize=13,
                            label=drafter + ' adaptive (mean K)')
            tau_axis.plot([adaptive.mean_k], [adaptive.tau], '*', color=color, markersize=13)
    speed_axis.axhline(1.0, color='grey', linewidth=0.8)
    speed_axis.set(xlabel='K (drafted tokens per round)', ylabel='speedup vs our plain decoding',
                   title='speedup against K')
    tau_axis.set(xlabel='K (drafted tokens per round)', ylabel='tau (tokens per decode pass)',
                 title='tau against K')
    for axis in (speed_axis, tau_axis):
        axis.set_xlim(left=0)
        axis.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def predicted_vs_measured(summary: Summary, path: Path) -> None:
    """Leviathan-predicted against measured speedup for our speculative systems (all prompts and per category)."""
    plt = _pyplot()
    fig, axis = plt.subplots(figsize=(5.5, 5))
    cells = [c for c in summary.cells if c.predicted_speedup]
    for cell in cells:
        big = cell.category == ALL
        axis.plot(cell.predicted_speedup, cell.speedup_vs_ours_plain, 'o' if big else '.',
                  color=DRAFTER_COLORS.get(cell.drafter), alpha=1.0 if big else 0.35, markersize=7 if big else 5)
        if big:
            axis.annotate(cell.system.removeprefix('ours/'), (cell.predicted_speedup, cell.speedup_vs_ours_plain),
                          fontsize=6, xytext=(3, 3), textcoords='offset points')
    values = [v for c in cells for v in (c.predicted_speedup, c.speedup_vs_ours_plain)] or [1.0]
    low, high = min(values + [1.0]) * 0.9, max(values + [1.0]) * 1.1
    axis.plot([low, high], [low, high], 'k--', linewidth=0.8, label='measured = predicted')
    axis.plot([low, high], [0.9 * low, 0.9 * high], 'k:', linewidth=0.8, label='90% efficiency')
    axis.set(xlim=(low, high), ylim=(low, high), xlabel='predicted speedup (Leviathan)',
             ylabel='measured speedup vs our plain', title='predicted vs measured (big: all prompts)')
    axis.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
