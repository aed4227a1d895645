"""Tests of scripts/check_module_cycles.py on tiny crates built in a temporary directory."""

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_module_cycles.py"


@pytest.fixture(scope="module")
def checker():
    spec = importlib.util.spec_from_file_location("check_module_cycles", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    # dataclasses look their module up while the class is built.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def make_crate(repo: Path, name: str, files: dict) -> Path:
    """Writes crates/<name>/ with a Cargo.toml and `files` (paths under src/ -> source)."""
    crate = repo / "crates" / name
    (crate / "src").mkdir(parents=True)
    (crate / "Cargo.toml").write_text(f'[package]\nname = "{name}"\n')
    for rel, text in files.items():
        path = crate / "src" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return crate


def edges(checker, crate: Path) -> set:
    graph = checker.build_graph(crate)
    src = crate / "src"
    return {(str(a.relative_to(src)), str(b.relative_to(src))) for a, b in graph.edges}


def cycles(checker, crate: Path) -> list:
    src = crate / "src"
    return [
        [str(f.relative_to(src)) for f in c] for c in checker.cycles(checker.build_graph(crate))
    ]


def test_two_files_using_each_other_are_a_cycle(checker, tmp_path, capsys):
    make_crate(
        tmp_path,
        "demo",
        {
            "lib.rs": "mod engine;\nmod jobs;\npub use engine::Engine;\n",
            "engine.rs": "use crate::jobs::Job;\npub struct Engine { jobs: Vec<Job> }\n",
            "jobs.rs": "pub struct Job;\nimpl Job { fn run(e: &crate::engine::Engine) {} }\n",
        },
    )
    assert cycles(checker, tmp_path / "crates" / "demo") == [["engine.rs", "jobs.rs"]]
    assert checker.main(["--root", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "demo: cycle of 2 files (engine <-> jobs)" in out
    assert "crates/demo/src/engine.rs -> crates/demo/src/jobs.rs  (line 1: crate::jobs::Job)" in out
    assert "1 cycle(s) in 1 crate(s)" in out


def test_a_child_using_its_parent_is_no_cycle(checker, tmp_path, capsys):
    crate = make_crate(
        tmp_path,
        "demo",
        {
            "lib.rs": "mod child;\npub struct Root;\n",
            "child.rs": "use crate::Root;\nfn f(_: super::Root) {}\n",
        },
    )
    # The parent's `mod child;` is no edge; the child's use of the parent's item is one.
    assert edges(checker, crate) == {("child.rs", "lib.rs")}
    assert cycles(checker, crate) == []
    assert checker.main(["--root", str(tmp_path)]) == 0
    assert "0 cycle(s) in 1 crate(s)" in capsys.readouterr().out


def test_a_name_re_exported_by_the_parent_names_the_file_defining_it(checker, tmp_path):
    crate = make_crate(
        tmp_path,
        "demo",
        {
            "lib.rs": "mod error;\nmod worker;\npub use error::Error;\npub use worker::Worker;\n",
            "error.rs": "pub enum Error { Bad }\n",
            "worker.rs": "use crate::Error;\npub struct Worker;\n",
        },
    )
    assert edges(checker, crate) == {
        ("lib.rs", "error.rs"),
        ("lib.rs", "worker.rs"),
        ("worker.rs", "error.rs"),
    }
    assert cycles(checker, crate) == []


def test_super_paths_resolve_from_the_files_module(checker, tmp_path):
    crate = make_crate(
        tmp_path,
        "demo",
        {
            "lib.rs": "mod net;\npub struct Top;\n",
            "net/mod.rs": "mod conn;\nmod frame;\npub struct Net;\n",
            "net/conn.rs": (
                "use super::frame::Frame;\n"
                "pub fn connect(_: super::super::Top) {}\n"
                "fn net() -> super::Net { todo!() }\n"
            ),
            "net/frame.rs": "pub struct Frame;\nfn g() { super::conn::connect(crate::Top); }\n",
        },
    )
    assert edges(checker, crate) == {
        ("net/conn.rs", "net/frame.rs"),
        ("net/conn.rs", "lib.rs"),
        ("net/conn.rs", "net/mod.rs"),
        ("net/frame.rs", "net/conn.rs"),
        ("net/frame.rs", "lib.rs"),
    }
    assert cycles(checker, crate) == [["net/conn.rs", "net/frame.rs"]]


def test_self_and_child_module_paths_are_edges(checker, tmp_path):
    crate = make_crate(
        tmp_path,
        "demo",
        {
            "lib.rs": "mod a;\nmod b;\nfn f() { a::go(); self::b::go(); }\n",
            "a.rs": "pub fn go() {}\n",
            "b.rs": "pub fn go() { std::process::exit(0) }\n",
        },
    )
    assert edges(checker, crate) == {("lib.rs", "a.rs"), ("lib.rs", "b.rs")}


def test_test_modules_comments_and_strings_are_ignored(checker, tmp_path):
    crate = make_crate(
        tmp_path,
        "demo",
        {
            "lib.rs": "mod a;\nmod b;\n#[cfg(test)]\nmod tests;\n",
            "a.rs": (
                "use crate::b::B;\n"
                "pub struct A;\n"
                "#[cfg(test)]\n"
                "mod tests {\n"
                "    use crate::a::A;\n"
                "    #[test]\n"
                "    fn t() { let _ = crate::b::B; }\n"
                "}\n"
            ),
            "b.rs": (
                "pub struct B;\n"
                "// crate::a::A in a comment\n"
                "/* crate::a::A /* nested */ crate::a::A */\n"
                'const S: &str = "crate::a::A";\n'
                'const R: &str = r#"crate::a::A "quoted""#;\n'
                "const C: char = '\"';\n"
                "fn f<'a>(x: &'a str) -> &'a str { x }\n"
                "#[cfg(test)]\n"
                "use crate::a::A;\n"
                "#[cfg(all(test, unix))]\n"
                "fn only_in_tests() { crate::a::A; }\n"
            ),
            "tests.rs": "use crate::a::A;\nuse crate::b::B;\n",
        },
    )
    assert edges(checker, crate) == {("a.rs", "b.rs")}
    assert cycles(checker, crate) == []
    assert all(f.name != "tests.rs" for f in checker.build_graph(crate).files)


def test_inline_modules_are_part_of_their_file(checker, tmp_path):
    crate = make_crate(
        tmp_path,
        "demo",
        {
            "lib.rs": "mod a;\nmod b;\n",
            "a.rs": "pub mod inner {\n    pub fn go() { super::super::b::go() }\n}\n",
            "b.rs": "pub fn go() {}\npub fn back() { crate::a::inner::go() }\n",
        },
    )
    assert edges(checker, crate) == {("a.rs", "b.rs"), ("b.rs", "a.rs")}
    assert cycles(checker, crate) == [["a.rs", "b.rs"]]


def test_list_prints_every_edge(checker, tmp_path, capsys):
    make_crate(
        tmp_path,
        "demo",
        {"lib.rs": "mod a;\npub use a::A;\n", "a.rs": "pub struct A;\n"},
    )
    assert checker.main(["--root", str(tmp_path), "--list", "demo"]) == 0
    out = capsys.readouterr().out
    assert "demo: 2 files, 1 edges" in out
    assert "crates/demo/src/lib.rs -> crates/demo/src/a.rs  (1 refs; line 2: a::A)" in out


def test_an_unknown_crate_is_an_error(checker, tmp_path):
    make_crate(tmp_path, "demo", {"lib.rs": ""})
    with pytest.raises(SystemExit) as e:
        checker.main(["--root", str(tmp_path), "nope"])
    assert e.value.code == 2
