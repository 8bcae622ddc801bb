"""`model.predictor=refusing` for CLI tests (`--config.imports=tests.pipelines.refusing_predictor`):
the fake predictor, refusing every request as the engine refuses a prompt longer than the
model's context."""

from pipelines.predictors import PREDICTORS


class RefusingPredictor:

  def predict(self, items):
    raise ValueError(f"request {items[0].request_id}: prompt has 999 tokens but the context is "
                     f"128 tokens")


PREDICTORS["refusing"] = lambda spec: RefusingPredictor()
