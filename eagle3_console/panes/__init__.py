"""The console's seven panes, one small widget per module."""

from eagle3_console.panes.evaluation import EvaluationPane
from eagle3_console.panes.extraction import ExtractionPane
from eagle3_console.panes.gpu import GpuPane
from eagle3_console.panes.jobs import JobsPane
from eagle3_console.panes.pipeline import PipelinePane
from eagle3_console.panes.server import ServerPane
from eagle3_console.panes.training import TrainingPane

__all__ = ["EvaluationPane", "ExtractionPane", "GpuPane", "JobsPane", "PipelinePane", "ServerPane", "TrainingPane"]
