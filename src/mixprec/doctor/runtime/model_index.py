"""What the observers need to know about the model: parameter names, embedding parameters."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["ModelIndex"]


class ModelIndex:
    """Parameter names and embedding parameters of a model, read once on first use.

    Args:
        model: the model, or None (then nothing has a name and nothing is an embedding).
    """

    def __init__(self, model: nn.Module | None = None) -> None:
        self._model = model
        self._names: dict[int, str] | None = None
        self._embeddings: set[int] | None = None

    @property
    def model(self) -> nn.Module | None:
        """The model indexed (None when none was given)."""
        return self._model

    @model.setter
    def model(self, model: nn.Module | None) -> None:
        self._model = model
        self._names = self._embeddings = None

    def name(self, param: torch.Tensor) -> str | None:
        """The qualified name of `param` in the model, or None."""
        if self._model is None:
            return None
        if self._names is None:
            self._names = {id(p): n for n, p in self._model.named_parameters()}
        return self._names.get(id(param))

    def embedding_ids(self) -> set[int]:
        """Ids of the parameters of embedding modules (unused rows are legitimately zero)."""
        if self._model is None:
            return set()
        if self._embeddings is None:
            self._embeddings = {
                id(p)
                for m in self._model.modules()
                if isinstance(m, nn.Embedding | nn.EmbeddingBag)
                for p in m.parameters(recurse=False)
            }
        return self._embeddings
