//! The layering ARCHITECTURE.md promises, checked on the sources: the two
//! front-ends (`src/pool/`, `src/lanes/`) never import each other, and the
//! shared files at the top of `src/` import neither; inside `src/pool/`,
//! each module uses only lower layers, but for the upward imports named
//! here and in ARCHITECTURE.md; and no source file grows past 900 lines.
//!
//! Only code is read: comments (doc links to the other front-end are
//! fine) are skipped.

use std::fs;
use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The file's lines that are code, not comments.
fn code_lines(text: &str) -> impl Iterator<Item = (usize, &str)> {
    text.lines()
        .enumerate()
        .map(|(i, l)| (i + 1, l.trim_start()))
        .filter(|(_, l)| !l.starts_with("//"))
}

#[test]
fn front_ends_and_shared_files_import_only_downwards() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut wrong = Vec::new();
    for file in &files {
        let rel = file.strip_prefix(&src).unwrap();
        let parts: Vec<_> = rel.components().collect();
        let forbidden: &[&str] = match parts.first().and_then(|c| c.as_os_str().to_str()) {
            Some("pool") => &["crate::lanes"],
            Some("lanes") => &["crate::pool"],
            Some("lib.rs") => &[],
            // A shared file at the top of `src/`.
            _ => &["crate::pool", "crate::lanes"],
        };
        let text = fs::read_to_string(file).unwrap();
        for (n, line) in code_lines(&text) {
            for f in forbidden {
                if line.contains(f) {
                    wrong.push(format!("src/{}:{n}: {line}", rel.display()));
                }
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "imports against the layering:\n{}",
        wrong.join("\n")
    );
}

/// No file in `src/` grows past what a reader takes in at once: a file
/// that does is holding more than one concept and should be split by them.
#[test]
fn no_source_file_is_over_900_lines() {
    const MAX_LINES: usize = 900;
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut long: Vec<_> = files
        .iter()
        .map(|f| (f, fs::read_to_string(f).unwrap().lines().count()))
        .filter(|&(_, n)| n > MAX_LINES)
        .map(|(f, n)| format!("{}: {n} lines", f.strip_prefix(&src).unwrap().display()))
        .collect();
    long.sort();
    assert!(
        long.is_empty(),
        "files over {MAX_LINES} lines:\n{}",
        long.join("\n")
    );
}

// ----- The layers inside `src/pool/` ---------------------------------------

/// `src/pool/`'s modules (a file or a folder each) by layer, bottom to top,
/// as ARCHITECTURE.md lists them ("Layering inside `src/pool/`"). A file
/// may use its own module and the modules of lower layers; modules on one
/// layer do not use each other, except those joined by `+`, which act as
/// one. The items of `pool/mod.rs` itself (`PoolKey`, `PoolHasher`) are
/// below every layer.
const LAYERS: &[&[&str]] = &[
    &["stats", "waker", "turns", "retry"],
    &["config", "handler+deadline+poison"],
    &["metrics"],
    &["inbox", "task", "source"],
    &["worker"],
    &["shared"],
    &["conserve", "observe"],
    &["mailbox"],
    &["receiver"],
    &["batch"],
    &["dispatcher", "spawn"],
    &["executor"],
];

/// The imports that run upward anyway: from, to, and the items (a path
/// naming one of them, as whole segments, passes; an upward import of
/// anything else fails). Each is a row of ARCHITECTURE.md's table of upward
/// imports too, with the same items and the reason.
const UPWARD: &[(&str, &str, &[&str])] = &[
    ("metrics", "source", &["SourceRef"]),
    ("metrics", "worker", &["WorkerCx"]),
    ("poison", "worker", &["WorkerCx::count_retry"]),
    ("task", "worker", &["WorkerCx"]),
    ("source", "shared", &["Shared"]),
    ("worker", "shared", &["Shared"]),
    ("worker", "conserve", &["Watched"]),
    ("worker", "observe", &["StepLocal"]),
    ("shared", "conserve", &["Idle"]),
    ("shared", "observe", &["Identity", "SlowSteps"]),
    ("shared", "spawn", &["Spawned"]),
];

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Ident(String),
    /// `::`
    Sep,
    Punct(char),
}

/// The tokens of `text` that matter for paths (words, `::`, single
/// punctuation), with their lines; comments (from `//` to the end of the
/// line) are dropped, so only code is read.
fn tokens(text: &str) -> Vec<(Tok, usize)> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let c: Vec<char> = line.split("//").next().unwrap().chars().collect();
        let mut i = 0;
        while i < c.len() {
            if c[i] == ':' && c.get(i + 1) == Some(&':') {
                out.push((Tok::Sep, n + 1));
                i += 2;
            } else if c[i].is_alphanumeric() || c[i] == '_' {
                let start = i;
                while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                    i += 1;
                }
                out.push((Tok::Ident(c[start..i].iter().collect()), n + 1));
            } else {
                if !c[i].is_whitespace() {
                    out.push((Tok::Punct(c[i]), n + 1));
                }
                i += 1;
            }
        }
    }
    out
}

fn is_ident(t: Option<&(Tok, usize)>, word: &str) -> bool {
    matches!(t, Some((Tok::Ident(w), _)) if w == word)
}

fn is(t: Option<&(Tok, usize)>, tok: &Tok) -> bool {
    t.is_some_and(|(x, _)| x == tok)
}

/// Parses a use tree (or an expression's path) at `j`, after `prefix`;
/// pushes each path it names, with its line, and returns where it ends.
fn use_tree(
    toks: &[(Tok, usize)],
    mut j: usize,
    mut prefix: Vec<String>,
    out: &mut Vec<(Vec<String>, usize)>,
) -> usize {
    match toks.get(j) {
        Some((Tok::Punct('{'), _)) => {
            j += 1;
            loop {
                if is(toks.get(j), &Tok::Punct('}')) || j >= toks.len() {
                    return j + 1;
                }
                j = use_tree(toks, j, prefix.clone(), out);
                if is(toks.get(j), &Tok::Punct(',')) {
                    j += 1;
                }
            }
        }
        Some((Tok::Punct('*'), line)) => {
            prefix.push("*".to_owned());
            out.push((prefix, *line));
            j + 1
        }
        Some((Tok::Ident(word), line)) => {
            prefix.push(word.clone());
            let next = toks.get(j + 2).map(|(t, _)| t);
            if is(toks.get(j + 1), &Tok::Sep)
                && matches!(
                    next,
                    Some(Tok::Ident(_) | Tok::Punct('{') | Tok::Punct('*'))
                )
            {
                use_tree(toks, j + 2, prefix, out)
            } else if is_ident(toks.get(j + 1), "as") {
                out.push((prefix, *line));
                j + 3
            } else {
                out.push((prefix, *line));
                j + 1
            }
        }
        _ => j,
    }
}

/// The tokens of `#[cfg(test)]` modules dropped: a unit test may build
/// the whole executor to test a part of it.
fn without_tests(toks: Vec<(Tok, usize)>) -> Vec<(Tok, usize)> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < toks.len() {
        let module = is_ident(toks.get(i), "mod")
            && matches!(toks.get(i + 1), Some((Tok::Ident(_), _)))
            && is(toks.get(i + 2), &Tok::Punct('{'));
        // The attributes and visibility before `mod`, back to the item before.
        let head = out
            .iter()
            .rev()
            .take_while(|(t, _)| !matches!(t, Tok::Punct(';' | '{' | '}')));
        let mut head = head.map(|(t, _)| t);
        if module
            && head.clone().any(|t| *t == Tok::Ident("cfg".to_owned()))
            && head.any(|t| *t == Tok::Ident("test".to_owned()))
        {
            let mut depth = 0;
            i += 2;
            loop {
                match toks.get(i) {
                    Some((Tok::Punct('{'), _)) => depth += 1,
                    Some((Tok::Punct('}'), _)) => depth -= 1,
                    None => break,
                    _ => {}
                }
                i += 1;
                if depth == 0 {
                    break;
                }
            }
        } else {
            out.push(toks[i].clone());
            i += 1;
        }
    }
    out
}

/// What a file's code names of the pool: each path under `crate::pool::`
/// (and each re-export at the crate's root that stands for one, from
/// `roots`), as segments after `crate::pool`, with its line; and each
/// relative path that climbs `k` modules up to a name, as (k, name, line).
#[allow(clippy::type_complexity)]
fn pool_paths(
    toks: &[(Tok, usize)],
    roots: &std::collections::HashMap<String, String>,
) -> (Vec<(Vec<String>, usize)>, Vec<(usize, String, usize)>) {
    let mut paths = Vec::new();
    let mut relative = Vec::new();
    for i in 0..toks.len() {
        let starts = i == 0 || !is(toks.get(i - 1), &Tok::Sep);
        if !starts || !is(toks.get(i + 1), &Tok::Sep) {
            continue;
        }
        if is_ident(toks.get(i), "crate") && !is_ident(toks.get(i.wrapping_sub(1)), "in") {
            let mut named = Vec::new();
            use_tree(toks, i + 2, Vec::new(), &mut named);
            for (mut segs, line) in named {
                if segs[0] == "pool" {
                    // `crate::pool` alone would hide what it is used for.
                    segs.remove(0);
                    if segs.is_empty() {
                        segs.push("self".to_owned());
                    }
                    paths.push((segs, line));
                } else if let Some(module) = roots.get(&segs[0]) {
                    segs.insert(0, module.clone());
                    paths.push((segs, line));
                }
            }
        } else if is_ident(toks.get(i), "super") {
            let mut k = 0;
            let mut j = i;
            while is_ident(toks.get(j), "super") && is(toks.get(j + 1), &Tok::Sep) {
                k += 1;
                j += 2;
            }
            if let Some((Tok::Ident(name), line)) = toks.get(j) {
                relative.push((k, name.clone(), *line));
            }
        }
    }
    (paths, relative)
}

/// Each pool module's layer and the name of the unit it belongs to.
fn layer_table() -> std::collections::HashMap<&'static str, (usize, &'static str)> {
    let mut table = std::collections::HashMap::new();
    for (layer, units) in LAYERS.iter().enumerate() {
        for unit in *units {
            for module in unit.split('+') {
                assert!(
                    table.insert(module, (layer, *unit)).is_none(),
                    "{module} is twice in LAYERS"
                );
            }
        }
    }
    table
}

#[test]
fn pool_modules_import_only_lower_layers_and_the_named_exceptions() {
    use std::collections::{HashMap, HashSet};

    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let pool = root.join("src/pool");
    let table = layer_table();
    let mut wrong = Vec::new();

    // Every module is placed, and every placed module exists.
    let mut modules = HashSet::new();
    for entry in fs::read_dir(&pool).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        if name != "mod.rs" {
            modules.insert(name.trim_end_matches(".rs").to_owned());
        }
    }
    for module in &modules {
        if !table.contains_key(module.as_str()) {
            wrong.push(format!("src/pool/{module} is not in LAYERS"));
        }
    }
    for module in table.keys() {
        if !modules.contains(*module) {
            wrong.push(format!(
                "LAYERS names {module}, which src/pool/ does not have"
            ));
        }
    }

    // The crate root's re-exports of pool items, so that `crate::Builder`
    // counts as `crate::pool::config::Builder`.
    let mut roots = HashMap::new();
    let lib = tokens(&fs::read_to_string(root.join("src/lib.rs")).unwrap());
    for i in 0..lib.len() {
        if is_ident(lib.get(i), "use") {
            let mut j = i + 1;
            if is_ident(lib.get(j), "crate") && is(lib.get(j + 1), &Tok::Sep) {
                j += 2;
            }
            if is_ident(lib.get(j), "pool") && is(lib.get(j + 1), &Tok::Sep) {
                let mut reexports = Vec::new();
                use_tree(&lib, j + 2, Vec::new(), &mut reexports);
                for (segs, _) in reexports {
                    roots.insert(segs.last().unwrap().clone(), segs[0].clone());
                }
            }
        }
    }

    let mut used = HashSet::new();
    let mut files = Vec::new();
    rust_files(&pool, &mut files);
    files.sort();
    for file in &files {
        let rel = file.strip_prefix(&pool).unwrap();
        let parts: Vec<_> = rel
            .components()
            .map(|c| c.as_os_str().to_str().unwrap().trim_end_matches(".rs"))
            .collect();
        if parts == ["mod"] {
            continue;
        }
        let from = parts[0];
        let Some(&(from_layer, from_unit)) = table.get(from) else {
            continue;
        };
        // How many `super`s reach `src/pool/` from the file's top level.
        let depth = parts.len() - usize::from(parts.last() == Some(&"mod"));
        let toks = without_tests(tokens(&fs::read_to_string(file).unwrap()));
        let (paths, relative) = pool_paths(&toks, &roots);
        let at = |line: usize| format!("src/pool/{}:{line}", rel.display());
        for (k, name, line) in relative {
            if k == depth && name != from && modules.contains(&name) {
                wrong.push(format!(
                    "{}: reaches `{name}` by `super::`: name it `crate::pool::{name}::…`, \
                     so this check sees it",
                    at(line)
                ));
            }
        }
        for (segs, line) in paths {
            let to = segs[0].as_str();
            if to == "self" || to == "*" {
                wrong.push(format!(
                    "{}: uses `crate::pool` itself: name the module, so this check sees it",
                    at(line)
                ));
                continue;
            }
            let Some(&(to_layer, to_unit)) = table.get(to) else {
                // An item of `pool/mod.rs`, below every layer.
                continue;
            };
            if to_unit == from_unit || to_layer < from_layer {
                continue;
            }
            let allowed = UPWARD.iter().find_map(|&(f, t, items)| {
                (f == from && t == to)
                    .then(|| {
                        let rest = format!("::{}::", segs[1..].join("::"));
                        items
                            .iter()
                            .find(|item| rest.contains(&format!("::{item}::")))
                    })
                    .flatten()
                    .map(|&item| (f, t, item))
            });
            match allowed {
                Some(exception) => {
                    used.insert(exception);
                }
                None => wrong.push(format!(
                    "{}: `{from}` (layer {}) uses `crate::pool::{}` ({} layer {}): \
                     move what it needs down, or name the import in UPWARD and \
                     in ARCHITECTURE.md with the reason",
                    at(line),
                    from_layer + 1,
                    segs.join("::"),
                    if to_layer == from_layer {
                        "its own"
                    } else {
                        "the higher"
                    },
                    to_layer + 1
                )),
            }
        }
    }

    // No exception outlives the import it names.
    for (from, to, items) in UPWARD {
        for item in *items {
            if !used.contains(&(*from, *to, *item)) {
                wrong.push(format!(
                    "UPWARD names `{from}` → `{to}` `{item}`, which no import uses any \
                     more: remove it here and in ARCHITECTURE.md"
                ));
            }
        }
    }

    assert!(
        wrong.is_empty(),
        "the pool's layering (ARCHITECTURE.md, \"Layering inside `src/pool/`\"):\n{}",
        wrong.join("\n")
    );
}

/// ARCHITECTURE.md's section on the pool's layers says what the test
/// above checks: the same layers, and one row per upward import with the
/// same items.
#[test]
fn architecture_md_states_the_pool_layers_checked_here() {
    let doc =
        fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("ARCHITECTURE.md")).unwrap();
    let section: Vec<&str> = doc
        .lines()
        .skip_while(|l| !l.starts_with("## Layering inside `src/pool/`"))
        .skip(1)
        .take_while(|l| !l.starts_with("## "))
        .collect();
    assert!(
        !section.is_empty(),
        "no layering section in ARCHITECTURE.md"
    );
    let ticked =
        |s: &str| -> Vec<String> { s.split('`').skip(1).step_by(2).map(str::to_owned).collect() };
    let mut wrong = Vec::new();

    // "1. `stats`, `waker`, …: what they are" — the names before the colon.
    let listed: Vec<Vec<String>> = section
        .iter()
        .filter(|l| {
            l.split_once(". ")
                .is_some_and(|(n, _)| n.parse::<usize>().is_ok())
        })
        .map(|l| {
            let mut names = ticked(l.split_once(':').map_or(*l, |(head, _)| head));
            names.sort();
            names
        })
        .collect();
    let checked: Vec<Vec<String>> = LAYERS
        .iter()
        .map(|units| {
            let mut names: Vec<String> = units
                .iter()
                .flat_map(|u| u.split('+'))
                .map(str::to_owned)
                .collect();
            names.sort();
            names
        })
        .collect();
    if listed != checked {
        wrong.push(format!(
            "its numbered layers {listed:?} are not LAYERS {checked:?}"
        ));
    }

    // "| `from` → `to` | `Item`, … | why |"
    let rows: Vec<(String, String, Vec<String>)> = section
        .iter()
        .filter(|l| l.starts_with("| `") && l.contains(" → "))
        .map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            let ends = ticked(cells[1]);
            (ends[0].clone(), ends[1].clone(), ticked(cells[2]))
        })
        .collect();
    for (from, to, items) in UPWARD {
        match rows.iter().find(|(f, t, _)| f == from && t == to) {
            None => wrong.push(format!("no row for `{from}` → `{to}`")),
            Some((_, _, named)) => {
                let mut named = named.clone();
                let mut items: Vec<String> = items.iter().map(|s| s.to_string()).collect();
                named.sort();
                items.sort();
                if named != items {
                    wrong.push(format!(
                        "the row `{from}` → `{to}` names {named:?}, UPWARD {items:?}"
                    ));
                }
            }
        }
    }
    for (from, to, _) in &rows {
        if !UPWARD.iter().any(|(f, t, _)| f == from && t == to) {
            wrong.push(format!("the row `{from}` → `{to}` is not in UPWARD"));
        }
    }
    assert!(
        wrong.is_empty(),
        "ARCHITECTURE.md's layering section and tests/architecture.rs disagree:\n{}",
        wrong.join("\n")
    );
}
