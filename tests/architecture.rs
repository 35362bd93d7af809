//! The layering ARCHITECTURE.md promises, checked on the sources: the two
//! front-ends (`src/pool/`, `src/lanes/`) never import each other, and the
//! shared files at the top of `src/` import neither; and no source file
//! grows past 900 lines.
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
