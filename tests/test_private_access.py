"""Nothing reads another evenzero class's private state across files (issue 19).

A private attribute (`_name`, not a dunder) belongs to the file that sets or defines it:
`self._x = ...`, `def _x`, a class-level `_x = ...` or `_x: T`. Reading `obj._x` or
`self._x` in a file that does neither, while another evenzero file owns `_x`, is the
coupling this test refuses: a part reaching into another's internals, or a mixin reading
state another file sets. Parts meet through public methods and Protocols instead.

Private names of torch or DeepSpeed (`module._parameters`, DeepSpeed's
`groups._get_expert_data_parallel_group`) are not evenzero's, so they are not checked
here unless an evenzero file also owns the same name.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "evenzero"

FOREIGN = {
    "_modules": "torch.nn.Module's registry (the DeepSpeed engine fills it as DeepSpeed's does)",
    "_parameters": "torch.nn.Module's registry",
    "_buffers": "torch.nn.Module's registry",
    "_version": "torch.Tensor's version counter (a module-level function shares the name)",
    "_name": "DeepSpeed's accelerator interface: a user's accelerator sets it "
             "(deepspeed/accelerator/real_accelerator.py@0.19.8)",
    "_set_ep_group": "DeepSpeed's MoE interface, called across its modules as DeepSpeed "
                     "does (deepspeed/moe/layer.py@0.19.8)",
}
"""Private names that belong to torch's or DeepSpeed's interfaces, which evenzero
implements or calls under the same name; why each is allowed."""


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def owned_names(tree: ast.AST) -> set[str]:
    """The private attribute names a file sets or defines."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_private(node.name):
            out.add(node.name)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                targets = []
                if isinstance(item, ast.Assign):
                    targets = item.targets
                elif isinstance(item, ast.AnnAssign):
                    targets = [item.target]
                out.update(t.id for t in targets if isinstance(t, ast.Name) and _is_private(t.id))
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for sub in ast.walk(t):
                    if isinstance(sub, ast.Attribute) and _is_private(sub.attr):
                        out.add(sub.attr)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("setattr", "object.__setattr__") and len(node.args) >= 2 \
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str) \
                and _is_private(node.args[1].value):
            out.add(node.args[1].value)
    return out


def read_names(tree: ast.AST) -> list[tuple[str, int]]:
    """Every private attribute a file reads: (name, line)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr) \
                and isinstance(node.ctx, ast.Load):
            out.append((node.attr, node.lineno))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2 \
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str) \
                and _is_private(node.args[1].value):
            out.append((node.args[1].value, node.lineno))
    return out


def violations(files: dict[str, ast.AST]) -> list[str]:
    owners: dict[str, set[str]] = defaultdict(set)
    owned = {}
    for name, tree in files.items():
        owned[name] = owned_names(tree)
        for attr in owned[name]:
            owners[attr].add(name)
    out = []
    for name, tree in files.items():
        for attr, line in read_names(tree):
            if attr not in owned[name] and owners.get(attr) and attr not in FOREIGN:
                out.append(f"{name}:{line} reads {attr}, which "
                           f"{', '.join(sorted(owners[attr]))} owns")
    return sorted(set(out))


def source_files() -> dict[str, ast.AST]:
    return {str(p.relative_to(SRC.parent)): ast.parse(p.read_text(), str(p))
            for p in sorted(SRC.rglob("*.py"))}


def test_no_file_reads_private_state_another_file_owns():
    found = violations(source_files())
    assert not found, ("private state read across files; give the owner a public method or "
                       "property instead:\n  " + "\n  ".join(found))


def test_the_check_catches_what_it_is_for():
    owner = ast.parse("class Engine:\n    def __init__(self):\n        self._policy = 1\n"
                      "    def _require(self):\n        return self._policy\n")
    reader = ast.parse("def save(engine):\n    engine._require()\n    return engine._policy\n")
    mixin = ast.parse("class Reader:\n    def clip(self):\n        return self._policy\n")
    torch_internals = ast.parse("def walk(m):\n    return m._parameters\n")
    found = violations({"a.py": owner, "b.py": reader, "c.py": mixin, "d.py": torch_internals})
    assert found == ["b.py:2 reads _require, which a.py owns",
                     "b.py:3 reads _policy, which a.py owns",
                     "c.py:3 reads _policy, which a.py owns"]
