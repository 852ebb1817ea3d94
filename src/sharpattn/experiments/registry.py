"""The reproductions that the command line runs: one `Experiment` line each (the protocol is
`sharpattn.lab.protocol`). Importing this module imports no experiment: each is imported when its
command runs."""

from __future__ import annotations

from ..lab.protocol import REGISTRY, Experiment, experiment

__all__ = ["REGISTRY"]

experiment(
    Experiment(
        name="selective-llm",
        module="sharpattn.experiments.selective_llm",
        short_help="Selective temperatures on SmolLM2, frozen or with LoRA.",
        help="Selective temperatures trained on a frozen SmolLM2 (base weights fixed): held-out "
        "perplexity at 1x, 2x and 4x the fine-tuning context against the unpatched model (Zhang et "
        "al.'s Table 3 in small). With --lora, the matched study: the same fine-tuning of low-rank "
        "adapters with and without selective temperatures.",
        profiles=(
            ("quick", "20 steps, 4 held-out windows at 1x and 2x the context"),
            ("paper", "100 steps, 8 windows at 1x, 2x and 4x the context"),
        ),
        out_help="Run folder (default runs/selective-llm-<profile>, with --lora "
        "runs/selective-llm-lora-<profile>); re-running resumes it.",
    )
)

experiment(
    Experiment(
        name="max-retrieval",
        module="sharpattn.experiments.max_retrieval",
        short_help="Softmax is not Enough, Table 1.",
        help="Softmax is not Enough, Table 1: train, evaluate over sizes, t-tests, figures, report.",
        profiles=(
            ("quick", "1 seed, 5,000 steps, sizes to 4,096"),
            ("paper", "10 seeds x 100,000 steps, sizes 16..16,384"),
        ),
        out_help="Run folder (default runs/max-retrieval-<profile>); re-running resumes it.",
        pool=True,
        transient=False,
    )
)

experiment(
    Experiment(
        name="max-retrieval-regularisers",
        module="sharpattn.experiments.regularisers",
        short_help="Table 1 under each reading of its L2 term.",
        help="Table 1's baseline under each reading of App. A.4's L2 term (λΣw², λ/2·Σw², without "
        "biases, AdamW), each a max-retrieval run in OUT/<name>, compared with the paper's column.",
        profiles=(
            ("quick", "2 seeds x 2,000 steps per reading, sizes to 2,048"),
            ("paper", "5 seeds x 100,000 steps per reading, sizes 16..2,048"),
        ),
        out_help="Study folder; re-running resumes it.",
        out_default="runs/max-retrieval-regularisers",
        pool=True,
    )
)

experiment(
    Experiment(
        name="selective",
        module="sharpattn.experiments.selective",
        short_help="Selective attention: graph, denoising, a char LM.",
        help="Selective attention (Zhang et al., NeurIPS 2024): graph next-token task, denoising and "
        "a character language model (ours) at 1x, 2x and 4x its training context.",
        profiles=(
            ("quick", "3 seeds, few steps, 4 LM variants"),
            ("paper", "The paper's steps and seeds, all twelve LM variants"),
        ),
        out_help="Run folder (default runs/selective-<profile>); re-running resumes it.",
    )
)

experiment(
    Experiment(
        name="backcopy",
        module="sharpattn.experiments.backcopy",
        short_help="Bigram-Backcopy: sinks, drains, residual peaks.",
        help="Bigram-Backcopy: attention sinks, value drains, residual peaks, and Theorem 2.",
        profiles=(
            ("quick", "d = 64, 64 tokens, batch 16, 600-1,500 steps per run"),
            ("paper", "The paper's settings, App. C.1"),
            ("medium", "d = 128, 128 tokens, batch 32, the paper's lr 3e-4 and 10,000 steps"),
        ),
        out_help="Run folder (default runs/backcopy-<profile>); re-running resumes it.",
        pool=True,
        transient=False,
    )
)

experiment(
    Experiment(
        name="backcopy-study",
        module="sharpattn.experiments.backcopy.studies",
        short_help="Bigram-Backcopy one-factor studies.",
        help="Bigram-Backcopy controlled studies (one factor at a time): relu-peak, sgd, fig7b, "
        "no-bos, structures; and simplified, App. C.3's simplified model of Theorem 2 trained by "
        "Adam.",
        profiles=(),
        out_help="Run folder (default runs/backcopy-study-<study>); re-running resumes it.",
        pool=True,
        transient=False,
    )
)

experiment(
    Experiment(
        name="clrs",
        module="sharpattn.experiments.clrs",
        short_help="CLRS-style algorithms, Fig. 8 in small.",
        help="CLRS-Text-style algorithms, softmax vs adaptive temperature in training (Softmax is not "
        "Enough's Figure 8 in small): accuracy in and beyond the training sizes.",
        profiles=(
            ("quick", "4 algorithms, 2 seeds, 1,500 steps per run, sizes to 16x"),
            ("paper", "8 algorithms, 5 seeds, 5,000 steps, sizes to 64x the training sizes"),
        ),
        out_help="Run folder (default runs/clrs-<profile>); re-running resumes it.",
        pool=True,
        lists=True,
    )
)

experiment(
    Experiment(
        name="leaderboard",
        module="sharpattn.experiments.leaderboard",
        short_help="Every attention method ranked on sequence tasks.",
        help="Every attention method on the same sequence tasks, seeds and budget, ranked by accuracy "
        "from the training sizes to a multiple of them (8x by default, 16x --standard, 256x --paper; "
        "area under accuracy against log size).",
        profiles=(
            ("quick", "flip_flop, every method, 2 seeds x 500 steps, sizes to 8x"),
            (
                "paper",
                "Every synthetic task, every method, 5 seeds, sizes to >= 256x, test "
                "sequences sampled adaptively",
            ),
            (
                "standard",
                "Every synthetic task, every method, 3 seeds, sizes to >= 16x, test "
                "sequences sampled adaptively",
            ),
            (
                "power",
                "The 6 informative tasks, one of each pair of identical methods, 6 seeds a "
                "method and 17 for softmax, each run trained until it solves the training "
                "sizes or stops improving; its plan fixed before the first job",
            ),
        ),
        out_help="Run folder (default runs/leaderboard-<profile>); re-running resumes it.",
        pool=True,
        lists=True,
        top_level=True,
        joins=True,
    )
)

experiment(
    Experiment(
        name="clrs-llm",
        module="sharpattn.experiments.clrs_llm",
        short_help="Fig. 8 by fine-tuning SmolLM2 with LoRA.",
        help="CLRS-Text algorithms on a fine-tuned SmolLM2: low-rank adapters trained with softmax "
        "and with adaptive temperature on the same budget (Softmax is not Enough's Figure 8), "
        "accuracy in and up to 4x beyond the training sizes.",
        profiles=(
            ("quick", "2 algorithms, 2 seeds, 40 steps of batch 4 per run, sizes to 4x"),
            (
                "paper",
                "3 algorithms trained at 4-8 items, 2 seeds, 400 steps of batch 8 per "
                "run, sizes to 4x",
            ),
        ),
        out_help="Run folder (default runs/clrs-llm-<profile>); re-running resumes it.",
    )
)
