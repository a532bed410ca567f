"""Loads skills/: SKILL.md front matter and prose, YAML tables validated strictly, values with citations."""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from finetune_mcp.common.errors import BadInput, NotFound
from finetune_mcp.shipped import shipped_dir

_FRONT = re.compile(r"\A---\n(.*?)\n---\n", re.S)
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*(?:\{#([A-Za-z0-9_.-]+)\})?\s*$", re.M)


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


@dataclass
class Skill:
    name: str
    description: str
    path: Path
    body: str
    anchors: dict[str, str]  # anchor -> heading text
    tables: dict[str, BaseModel] = field(default_factory=dict)

    def section(self, anchor: str) -> str:
        """The prose under the heading with this anchor, up to the next heading of the same or higher level."""
        for m in _HEADING.finditer(self.body):
            if (m.group(3) or slug(m.group(2))) == anchor:
                level = len(m.group(1))
                rest = self.body[m.end():]
                nxt = re.search(rf"^#{{1,{level}}}\s", rest, re.M)
                return rest[: nxt.start() if nxt else len(rest)].strip()
        raise NotFound(f"skill {self.name!r} has no section #{anchor}")


def _did_you_mean(word: str, options) -> str:
    m = difflib.get_close_matches(word, list(options), n=1)
    return f" (did you mean {m[0]!r}?)" if m else ""


def explain(e: ValidationError, model: type[BaseModel]) -> str:
    """One line per problem; unknown keys get a did-you-mean hint from the fields allowed at that place."""
    out = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            key = str(err["loc"][-1])
            out.append(f"unknown key {loc!r}{_did_you_mean(key, _fields_at(model, err['loc'][:-1]))}")
        else:
            out.append(f"{loc or '(top)'}: {err['msg']}")
    return "; ".join(out)


def _fields_at(model: type[BaseModel], loc) -> list[str]:
    """The field names allowed at `loc` inside `model`, stepping through dict/list values and Optionals."""
    import typing

    def unwrap(t):
        # -> (type, is_container): Optional/Union pick their model arm; dict/list step to the value type.
        for _ in range(8):
            origin = typing.get_origin(t)
            if origin in (dict, list, tuple, set) or origin is typing.Union or str(origin) == "types.UnionType":
                args = [a for a in typing.get_args(t) if a is not type(None)]
                if origin in (dict, list, tuple, set):
                    return args[-1] if args else t, True
                models = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
                t = models[0] if models else (args[0] if args else t)
                continue
            return t, False
        return t, False

    cur: Any = model
    skip_key = False
    for part in loc:
        if skip_key:
            skip_key = False
            continue
        if not (isinstance(cur, type) and issubclass(cur, BaseModel)):
            return []
        f = cur.model_fields.get(str(part))
        if f is None:
            return []
        cur, skip_key = unwrap(f.annotation)
    if skip_key:
        return []
    return list(cur.model_fields) if isinstance(cur, type) and issubclass(cur, BaseModel) else []


class Skills:
    def __init__(self, root: Path):
        from finetune_mcp.skilltables import TABLES

        self.root = root
        self.skills: dict[str, Skill] = {}
        errors: list[str] = []
        for md in sorted(root.glob("*/SKILL.md")):
            try:
                sk = self._load_skill(md)
            except BadInput as e:
                errors.append(str(e))
                continue
            for tf in sorted((md.parent / "tables").glob("*.yaml")):
                model = TABLES.get((sk.name, tf.stem))
                if model is None:
                    errors.append(f"{tf}: no schema registered for table ({sk.name!r}, {tf.stem!r}) in skilltables.py")
                    continue
                try:
                    raw = yaml.safe_load(tf.read_text(encoding="utf-8"))
                    sk.tables[tf.stem] = model.model_validate(raw)
                except yaml.YAMLError as e:
                    errors.append(f"{tf}: not valid YAML: {e}")
                except ValidationError as e:
                    errors.append(f"{tf}: {explain(e, model)}")
            self.skills[sk.name] = sk
        if errors:
            raise BadInput("skills/ failed validation:\n  " + "\n  ".join(errors), where=str(root), fix="correct the skill files named above")

    @staticmethod
    def _load_skill(md: Path) -> Skill:
        text = md.read_text(encoding="utf-8")
        m = _FRONT.match(text)
        if not m:
            raise BadInput(f"{md}: missing YAML front matter (--- name/description ---)")
        front = yaml.safe_load(m.group(1)) or {}
        unknown = set(front) - {"name", "description", "license", "metadata"}
        if unknown:
            raise BadInput(f"{md}: unknown front-matter keys {sorted(unknown)}")
        if not front.get("name") or not front.get("description"):
            raise BadInput(f"{md}: front matter needs both name and description")
        if front["name"] != md.parent.name:
            raise BadInput(f"{md}: name {front['name']!r} differs from its folder {md.parent.name!r}")
        body = text[m.end():]
        anchors = {}
        for h in _HEADING.finditer(body):
            anchors[h.group(3) or slug(h.group(2))] = h.group(2)
        return Skill(front["name"], str(front["description"]).strip(), md.parent, body, anchors)

    def get(self, name: str) -> Skill:
        sk = self.skills.get(name)
        if sk is None:
            raise NotFound(f"no skill named {name!r}{_did_you_mean(name, self.skills)}")
        return sk

    def table(self, skill: str, table: str) -> Any:
        sk = self.get(skill)
        t = sk.tables.get(table)
        if t is None:
            raise NotFound(f"skill {skill!r} has no table {table!r}{_did_you_mean(table, sk.tables)}")
        return t

    def cite(self, skill: str, anchor: str) -> str:
        sk = self.get(skill)
        if anchor not in sk.anchors:
            raise NotFound(f"skill {skill!r} has no section #{anchor}{_did_you_mean(anchor, sk.anchors)}")
        return f"{skill}#{anchor}"


@lru_cache(maxsize=4)
def _load(root: str) -> Skills:
    return Skills(Path(root))


def load_skills(root: Path | None = None) -> Skills:
    return _load(str(root or shipped_dir("skills")))
