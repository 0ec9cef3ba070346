"""The one table of the element-wise update rules, from which every build's glue is made.

An element-wise rule updates each element from its own weight, gradient and state alone
(SGD, Adagrad, FTRL). Its arithmetic is a struct in ``csrc/rules.h``; everything between
that struct and a caller is the same for every such rule up to names and argument lists,
so it is written once, as a template, and made per rule from the entry here (FBGEMM's
``codegen/genscript/optimizers.py`` pattern: one record per optimizer):

- at build time, ``csrc/codegen.py`` (run by ``setup.py``) writes, into ``csrc/gen/``
  (not in git), the CPU entry points of every ISA build on float32 and half rows, their
  Cython wrappers, the CUDA entry points (float32 and half) and their C declarations,
  and the list of rules the CPU emulation of the CUDA kernels runs;
- at import time, :func:`define` makes the Python functions from it: the kernel contract
  (:mod:`distemb.kernels.ops`), the validating wrappers of :mod:`distemb.kernels`,
  :mod:`distemb.kernels.half`, :mod:`distemb.kernels.cuda` and
  :mod:`distemb.kernels.cuda_half`, the ctypes signatures, the half reference wrapper and
  the tests' CPU stand-ins of the CUDA kernels.

The numpy twin of each rule (:mod:`distemb.kernels.reference`) is NOT made from here: it
is the independent oracle, written from the published formula. Rules that are not
element-wise (row-wise Adagrad reduces a row first; Adam counts steps per row) are
written by hand in every build and named in :data:`CUSTOM_KERNELS`.

This module imports nothing from distemb (``setup.py`` loads it by path).

Example:
    >>> [r.kernel for r in RULES]
    ['sgd_update', 'adagrad_update', 'ftrl_update']
    >>> rule_named("ftrl").states
    ('accum', 'linear')
"""
from dataclasses import dataclass
from typing import Callable, Dict, Tuple

#: The two C types a hyperparameter can cross the C boundary as.
CTYPES = ("float", "double")


@dataclass(frozen=True)
class ElementwiseRule:
    """One element-wise rule: what its kernels take, in order.

    Every build's entry point takes ``weight``, then the state arrays (each (R, D)
    float32), then ``rows`` and ``grads``, then the hyperparameters, then the build's
    own trailing arguments; the rule's struct in ``csrc/rules.h`` builds its parameters
    from the hyperparameters as doubles in this order.

    Attributes:
        name: the rule, as ``csrc/rules.h``'s functions name it; its kernels are
            ``<name>_update`` (C API: ``distemb_cuda_<name>_update`` and
            ``distemb_cuda_half_<name>_update``).
        struct: the struct in ``distemb::rules`` (``csrc/rules.h``).
        states: the names of its per-element float32 state arrays.
        hyper: (name, C type) of each hyperparameter, C type ``'float'`` or ``'double'``.
        positive: (name, what it is) of the hyperparameters that must be > 0 (refused
            by every build otherwise, the message naming both).
        summary: the contract's one-line description.
        doc: more of the contract's docstring (the formula), may be empty.

    Example:
        >>> rule = rule_named("adagrad")
        >>> rule.kernel, rule.params()
        ('adagrad_update', 'weight, state_sum, rows, grads, clr, eps, num_threads=1')
    """

    name: str
    struct: str
    states: Tuple[str, ...]
    hyper: Tuple[Tuple[str, str], ...]
    summary: str
    positive: Tuple[Tuple[str, str], ...] = ()
    doc: str = ""

    @property
    def kernel(self) -> str:
        """The kernel's name in every implementation: ``<name>_update``."""
        return self.name + "_update"

    @property
    def hyper_names(self) -> Tuple[str, ...]:
        return tuple(h for h, _ in self.hyper)

    def params(self) -> str:
        """The contract's parameter list (without ``self``), as Python source."""
        return ", ".join(("weight",) + self.states + ("rows", "grads") + self.hyper_names
                         + ("num_threads=1",))


RULES: Tuple[ElementwiseRule, ...] = (
    ElementwiseRule(
        name="sgd", struct="Sgd", states=(), hyper=(("lr", "float"),),
        summary="``weight[rows] -= lr * grads``."),
    ElementwiseRule(
        name="adagrad", struct="Adagrad", states=("state_sum",),
        hyper=(("clr", "float"), ("eps", "float")),
        summary="torch.optim.Adagrad: ``s += g*g; w -= clr * g / (sqrt(s) + eps)``; "
                "s is (R, D)."),
    ElementwiseRule(
        name="ftrl", struct="Ftrl", states=("accum", "linear"),
        hyper=(("lr", "double"), ("lr_power", "double"), ("l1", "double"), ("l2", "double"),
               ("l2_shrinkage", "double"), ("beta", "double")),
        positive=(("lr", "learning rate"),),
        summary="FTRL-Proximal as ``tf.keras.optimizers.Ftrl``, element-wise in float32.",
        doc="``g' = g + 2 l2_shrinkage w; n' = n + g^2; z += g' - (n'^-p - n^-p) / lr * w;\n"
            "w = (clip(z, -l1, l1) - z) / (n'^-p / lr + 2 (l2 + beta / (2 lr)))`` with\n"
            "``p = lr_power``, accumulator ``n = accum`` and linear term ``z = linear``, both\n"
            "(R, D); ``lr > 0``."),
)

#: The update kernels written by hand in every build (not element-wise).
CUSTOM_KERNELS = ("rowwise_adagrad_update", "adam_update")

#: Every update kernel of the contract: the table's rules, then the hand-written ones.
UPDATE_KERNELS = tuple(r.kernel for r in RULES) + CUSTOM_KERNELS


def rule_named(name: str) -> ElementwiseRule:
    """The table's rule called ``name``.

    Raises:
        KeyError: no element-wise rule has that name.
    """
    for rule in RULES:
        if rule.name == name:
            return rule
    raise KeyError(f"rule: expected one of {[r.name for r in RULES]}, got {name!r}")


def check_table() -> None:
    """Refuse a malformed table (run on import, so a bad entry fails every build)."""
    seen = set()
    for rule in RULES:
        if not rule.name.isidentifier() or rule.name in seen:
            raise ValueError(f"rule_table: bad or repeated rule name {rule.name!r}")
        seen.add(rule.name)
        for h, ctype in rule.hyper:
            if ctype not in CTYPES:
                raise ValueError(f"rule_table: {rule.name}.{h}: C type {ctype!r}, expected "
                                 f"one of {CTYPES}")
        if not {h for h, _ in rule.positive} <= set(rule.hyper_names):
            raise ValueError(f"rule_table: {rule.name}.positive names no hyperparameter")


check_table()


def define(source: str, namespace: Dict, name: str, doc: str = "") -> Callable:
    """Compile one generated function from ``source`` in ``namespace`` (a module's globals,
    so its helpers resolve there) and return it with ``doc`` as its docstring; its
    signature is the source's own, as ``inspect.signature`` reads it."""
    scope: Dict = {}
    exec(compile(source, f"<distemb rule_table: {name}>", "exec"), namespace, scope)
    fn = scope[name]
    fn.__doc__ = doc or None
    fn.__module__ = namespace.get("__name__", fn.__module__)
    return fn


def checks(rule: ElementwiseRule, indent: str = "    ") -> str:
    """Python source refusing the rule's non-positive hyperparameters (ValueError)."""
    return "".join(
        f"{indent}if not {h} > 0:\n"
        f"{indent}    raise ValueError(f\"{h}: expected a positive {what}, got {{{h}!r}}\")\n"
        for h, what in rule.positive)


def floats(rule: ElementwiseRule) -> str:
    """``float(h), ...`` of the rule's hyperparameters, as Python source."""
    return ", ".join(f"float({h})" for h in rule.hyper_names)
