"""The layout rules of docs/design.md, measured by scripts/layout_report.py on the source tree."""

import ast
import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "layout_report.py"


def load_report():
    spec = importlib.util.spec_from_file_location("layout_report", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_only_the_wiring_takes_the_whole_config_and_imports_flow_down():
    result = load_report().report()
    assert result["outside_wiring"] == {}
    assert result["section_reads_outside_section"] == {}
    assert result["import_cycles"] == []
    assert result["upward_imports"] == []
    assert "asyncgrpo.trainer.recipe" in result["wiring"]  # the measure sees the whole config where it is


def test_a_component_reading_a_key_its_sections_lack_is_reported():
    layout = load_report()
    tree = ast.parse("class A:\n"
                     "    def __init__(self, cfg: LossSettings):\n"
                     "        self.cfg = cfg\n"
                     "    def f(self, other: GenerationSettings, cfg):\n"
                     "        return self.cfg.beta + self.cfg.lora_r + other.top_p + other.beta\n"
                     "    def g(self):\n"
                     "        kept = self.cfg\n"
                     "        return kept.epsilon + kept.seed\n")
    takers, strays = layout.config_takers(tree, layout.section_keys())
    assert takers == ["f(cfg)"]
    assert strays == ["A.g.kept.seed", "A.self.cfg.lora_r", "f.other.beta"]
