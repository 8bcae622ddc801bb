"""Task layer: prompts, answer extraction and metrics (Beam-free, pure Python)."""

from pipelines.tasks.gsm8k import (COMPLETION_STOP_SEQUENCES, FEWSHOT_EXEMPLARS,
                                   FEWSHOT_PREFIX, GSM8KScore, extract_flexible,
                                   extract_strict, fewshot_messages, fewshot_prompt,
                                   score_gsm8k, zero_shot_messages)
from pipelines.tasks.humaneval import (STOP_SEQUENCES as HUMANEVAL_STOP_SEQUENCES,
                                       build_program, mean_pass_at_k, pass_at_k,
                                       pass_at_k_all, program_for, truncate_completion)
from pipelines.tasks.text import ChatMessage, truncate_at_stop

__all__ = [
    "COMPLETION_STOP_SEQUENCES", "ChatMessage", "FEWSHOT_EXEMPLARS", "FEWSHOT_PREFIX",
    "GSM8KScore", "HUMANEVAL_STOP_SEQUENCES", "build_program", "extract_flexible",
    "extract_strict", "fewshot_messages", "fewshot_prompt", "mean_pass_at_k",
    "pass_at_k", "pass_at_k_all", "program_for", "score_gsm8k", "truncate_at_stop",
    "truncate_completion", "zero_shot_messages",
]
