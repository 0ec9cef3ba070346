"""The sparse optimizers. Each names its rule and computes that rule's hyperparameters.

Concurrency (all of them): the rule runs on the rows' owner, which applies one update per
shard at a time, so a row and its state have one writer (DESIGN.md). Step counts are
global per table and live with the optimizer, exactly as ``torch.optim`` counts them.
"""
from typing import Iterable, Tuple, Union

from distemb.embedding import DistEmbedding
from distemb.enums import Choice
from distemb.optim.base import SparseOptimizer, check_hyper
from distemb.rules import AdagradHyper, AdamHyper, FtrlHyper, RuleName, SGDHyper

Params = Union[DistEmbedding, Iterable[DistEmbedding]]


class StepMode(Choice):
    """How Adam counts steps for its bias correction.

    Example:
        >>> StepMode("per_row") is StepMode.PER_ROW
        True
    """

    #: one count per table, advanced by each step() that table got gradients (torch).
    GLOBAL = "global"
    #: each row counts its own updates (DGL's SparseAdam, lazy Adam); the counts are state.
    PER_ROW = "per_row"


class SparseSGD(SparseOptimizer):
    """``w -= lr * g``, equal to ``torch.optim.SGD`` on ``nn.Embedding(sparse=True)``.

    Example:
        >>> from distemb import DistEmbedding
        >>> opt = SparseSGD([DistEmbedding(10, 4, name="doc-sgd")], lr=0.1)
        >>> opt.param_groups[0]["lr"]
        0.1
    """

    rule = RuleName.SGD

    def __init__(self, params: Params, lr: float, check_finite: bool = False):
        super().__init__(params, {"lr": check_hyper("lr", lr)}, check_finite)

    def hyper(self, group: dict, step: int) -> SGDHyper:
        return SGDHyper(lr=group["lr"])


class SparseAdagrad(SparseOptimizer):
    """``torch.optim.Adagrad`` on sparse rows: ``s += g^2; w -= clr * g / (sqrt(s) + eps)``.

    ``clr = lr / (1 + (step - 1) * lr_decay)`` with a global step count, as torch.

    Example:
        >>> from distemb import DistEmbedding
        >>> opt = SparseAdagrad([DistEmbedding(10, 4, name="doc-adagrad")], lr=0.01)
    """

    rule = RuleName.ADAGRAD

    def __init__(self, params: Params, lr: float, eps: float = 1e-10, lr_decay: float = 0.0,
                 initial_accumulator_value: float = 0.0, check_finite: bool = False):
        super().__init__(params, {
            "lr": check_hyper("lr", lr), "eps": check_hyper("eps", eps),
            "lr_decay": check_hyper("lr_decay", lr_decay),
            "initial_accumulator_value": check_hyper("initial_accumulator_value",
                                                     initial_accumulator_value)}, check_finite)

    def rule_options(self) -> dict:
        return {"initial_accumulator_value": self.defaults["initial_accumulator_value"]}

    def hyper(self, group: dict, step: int) -> AdagradHyper:
        return AdagradHyper(clr=group["lr"] / (1 + (step - 1) * group["lr_decay"]),
                            eps=group["eps"])


class SparseRowWiseAdagrad(SparseAdagrad):
    """Row-wise Adagrad: one accumulator per row, ``s += mean(g^2)`` (PyTorch-BigGraph, FBGEMM).

    Uses D times less state memory than :class:`SparseAdagrad`; eps is placed as torch
    places it: ``w -= clr * g / (sqrt(s) + eps)``.

    Example:
        >>> from distemb import DistEmbedding
        >>> opt = SparseRowWiseAdagrad([DistEmbedding(10, 4, name="doc-rowwise")], lr=0.01)
    """

    rule = RuleName.ROWWISE_ADAGRAD


class SparseAdam(SparseOptimizer):
    """``torch.optim.SparseAdam``: lazy Adam on the rows a batch touched.

    Args:
        params: the DistEmbeddings to optimise.
        lr: learning rate (>= 0).
        betas: decay rates of the first and second moment estimates, each in [0, 1).
        eps: added to the denominator, where ``torch.optim.SparseAdam`` adds it.
        check_finite: refuse a step whose gradients hold NaN or infinity (see
            :class:`~distemb.optim.base.SparseOptimizer`; off by default).
        step_mode: ``'global'`` (default, torch's semantics: one step count per table,
            incremented each ``step()`` that table got gradients, used for every row's
            bias correction) or ``'per_row'`` (each row counts its own updates, as DGL's
            SparseAdam and lazy-Adam do; the counts are optimizer state).

    Example:
        >>> from distemb import DistEmbedding
        >>> opt = SparseAdam([DistEmbedding(10, 4, name="doc-adam")], lr=0.01)
    """

    def __init__(self, params: Params, lr: float = 0.001,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 step_mode: Union[StepMode, str] = StepMode.GLOBAL,
                 check_finite: bool = False):
        try:
            step_mode = StepMode(step_mode)
        except ValueError:
            choices = " or ".join(repr(m.value) for m in StepMode)
            raise ValueError(f"step_mode: expected {choices}, got {step_mode!r}") from None
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"betas: expected a pair of floats, got {betas!r}")
        self.rule = RuleName.ADAM if step_mode is StepMode.GLOBAL else RuleName.ADAM_ROW_STEP
        super().__init__(params, {
            "lr": check_hyper("lr", lr), "eps": check_hyper("eps", eps),
            "betas": (check_hyper("betas[0]", betas[0], 0.0, 1.0),
                      check_hyper("betas[1]", betas[1], 0.0, 1.0)),
            "step_mode": step_mode.value}, check_finite)

    @property
    def _beta1(self) -> float:  # DGL's attribute name (compatibility alias)
        return self.param_groups[0]["betas"][0]

    @property
    def _beta2(self) -> float:
        return self.param_groups[0]["betas"][1]

    def hyper(self, group: dict, step: int) -> AdamHyper:
        beta1, beta2 = group["betas"]
        return AdamHyper(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], step=step)


class SparseFtrl(SparseOptimizer):
    """FTRL-Proximal on sparse rows, the formula of ``tf.keras.optimizers.Ftrl``.

    Per element, with accumulator ``n`` (starting at ``initial_accumulator_value``) and
    linear term ``z`` (starting at 0), ``p = learning_rate_power``::

        g' = g + 2 * l2_shrinkage * w;  n' = n + g^2
        z += g' - (n'^-p - n^-p) / lr * w
        w = (clip(z, -l1, l1) - z) / (n'^-p / lr + 2 * (l2 + beta / (2 * lr)))

    Rows a step did not touch keep their weight and state (lazy, as Keras' sparse
    update); the gradients of a row's duplicate ids in one step are summed first, as
    torch sums a sparse gradient (and as Keras sums duplicate indices).

    Args:
        lr: learning rate, > 0.
        learning_rate_power: <= 0; -0.5 (default) scales like Adagrad, 0 is a fixed rate.
        initial_accumulator_value: at least 0 (Keras' default 0.1).
        l1_regularization_strength: at least 0.
        l2_regularization_strength: at least 0.
        l2_shrinkage_regularization_strength: at least 0.
        beta: at least 0.

    Example:
        >>> from distemb import DistEmbedding
        >>> opt = SparseFtrl([DistEmbedding(10, 4, name="doc-ftrl")], lr=0.1,
        ...                  l1_regularization_strength=0.01)
        >>> opt.param_groups[0]["l1"]
        0.01
    """

    rule = RuleName.FTRL

    def __init__(self, params: Params, lr: float = 0.001, learning_rate_power: float = -0.5,
                 initial_accumulator_value: float = 0.1,
                 l1_regularization_strength: float = 0.0,
                 l2_regularization_strength: float = 0.0,
                 l2_shrinkage_regularization_strength: float = 0.0, beta: float = 0.0,
                 check_finite: bool = False):
        if isinstance(learning_rate_power, bool) or \
                not isinstance(learning_rate_power, (int, float)) or \
                not learning_rate_power <= 0:
            raise ValueError(f"learning_rate_power: expected a number <= 0, got "
                             f"{learning_rate_power!r}")
        super().__init__(params, {
            "lr": check_hyper("lr", lr, low_open=True),
            "lr_power": float(learning_rate_power),
            "initial_accumulator_value": check_hyper("initial_accumulator_value",
                                                     initial_accumulator_value),
            "l1": check_hyper("l1_regularization_strength", l1_regularization_strength),
            "l2": check_hyper("l2_regularization_strength", l2_regularization_strength),
            "l2_shrinkage": check_hyper("l2_shrinkage_regularization_strength",
                                        l2_shrinkage_regularization_strength),
            "beta": check_hyper("beta", beta)}, check_finite)

    def rule_options(self) -> dict:
        return {"initial_accumulator_value": self.defaults["initial_accumulator_value"]}

    def hyper(self, group: dict, step: int) -> FtrlHyper:
        return FtrlHyper(lr=group["lr"], lr_power=group["lr_power"], l1=group["l1"],
                         l2=group["l2"], l2_shrinkage=group["l2_shrinkage"],
                         beta=group["beta"])
