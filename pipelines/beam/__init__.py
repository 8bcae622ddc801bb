"""Beam side of the evaluation: RunInference handler, result store, the job graph, options."""

from pipelines.beam.handler import PredictorModelHandler
from pipelines.beam.options import beam_args, pipeline_options
from pipelines.beam.pipeline import EvalPlan, build_pipeline, build_plan, plan_items, work_items
from pipelines.beam.store import ResultStore

__all__ = [
    "EvalPlan", "PredictorModelHandler", "ResultStore", "beam_args", "build_pipeline",
    "build_plan", "pipeline_options", "plan_items", "work_items",
]
