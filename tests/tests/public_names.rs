//! Public type names are unique across the workspace.
//!
//! A reader who meets `Message` or `WeightType` in a signature should not have to ask which one: every `pub`
//! struct, enum, trait, union and type alias declared in the library and binary crates' sources has a name no other
//! `pub` type in the workspace has. The only exception is an alias that instantiates a generic type of the same name
//! (`pub type PagePool = device::pages::PagePool<WgpuContext>`): it names the same type.
//!
//! Crate-private items (`pub(crate)`, `pub(super)`, `pub(in …)`) and test modules (`#[cfg(test)] mod …`, files
//! named `tests.rs` or under a `tests` folder) are not part of any public surface and are left out.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

const CRATES: &[&str] = &["engine", "server", "kv", "kernels-native", "benches", "cli", "shaders-wgsl"];

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ has a parent").to_path_buf()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            if p.file_name().is_some_and(|n| n == "tests") {
                continue;
            }
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") && p.file_name().is_some_and(|n| n != "tests.rs") {
            out.push(p);
        }
    }
}

/// One `pub` type declaration: its name, and for an alias the text after `=`.
#[derive(Debug, PartialEq)]
struct Decl {
    name: String,
    alias_of: Option<String>,
}

/// The `pub` type declarations of one source file, outside `#[cfg(test)]` modules.
fn declarations(src: &str) -> Vec<Decl> {
    let mut out = Vec::new();
    let mut skip_depth: Option<i64> = None; // brace depth at which a test module started
    let mut depth: i64 = 0;
    let mut cfg_test = false;
    for line in src.lines() {
        let t = line.trim_start();
        if skip_depth.is_none() {
            if t.starts_with("#[cfg(test)]") {
                cfg_test = true;
            } else if cfg_test && t.starts_with("mod ") && t.contains('{') {
                skip_depth = Some(depth);
                cfg_test = false;
            } else if !t.starts_with("#[") && !t.is_empty() && !t.starts_with("//") {
                cfg_test = false;
                if let Some(d) = parse_decl(t) {
                    out.push(d);
                }
            }
        }
        for c in line.chars() {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                _ => {}
            }
        }
        if skip_depth.is_some_and(|d| depth <= d) {
            skip_depth = None;
        }
    }
    out
}

fn parse_decl(t: &str) -> Option<Decl> {
    let rest = t.strip_prefix("pub ")?;
    let (kind, rest) = rest.split_once(' ')?;
    if !matches!(kind, "struct" | "enum" | "trait" | "union" | "type") {
        return None;
    }
    let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
    if name.is_empty() {
        return None;
    }
    let alias_of = (kind == "type").then(|| rest.split_once('=').map(|(_, r)| r.trim().to_string())).flatten();
    Some(Decl { name, alias_of })
}

/// Whether an alias's right-hand side is a workspace path whose last segment is `name` (an instantiation of that
/// type). An alias of a standard-library type (`pub type Result<T> = std::result::Result<T, E>`) is a name of its own.
fn aliases_same_name(name: &str, rhs: &str) -> bool {
    let path = rhs.split(['<', ';']).next().unwrap_or("").trim();
    let std_path = ["std::", "core::", "alloc::"].iter().any(|p| path.starts_with(p));
    path.rsplit("::").next() == Some(name) && path.contains("::") && !std_path
}

#[test]
fn declaration_scanner_sees_what_it_should() {
    let src = "pub struct A;\npub(crate) struct B;\npub enum C { X }\npub type D = x::D<u8>;\n\
               #[cfg(test)]\nmod tests {\n    pub struct E;\n}\npub trait F {}\n";
    let names: Vec<String> = declarations(src).into_iter().map(|d| d.name).collect();
    assert_eq!(names, ["A", "C", "D", "F"]);
    assert!(aliases_same_name("D", "x::D<u8>;"));
    assert!(!aliases_same_name("Result", "std::result::Result<T, KvError>;"));
    assert!(!aliases_same_name("KvResult", "std::result::Result<T, KvError>;"));
}

#[test]
fn public_type_names_are_unique_across_the_workspace() {
    let root = workspace_root();
    let mut seen: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut files_read = 0;
    for krate in CRATES {
        let mut files = Vec::new();
        rust_files(&root.join(krate).join("src"), &mut files);
        files.sort();
        for f in files {
            let src = std::fs::read_to_string(&f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
            files_read += 1;
            for d in declarations(&src) {
                if d.alias_of.as_deref().is_some_and(|rhs| aliases_same_name(&d.name, rhs)) {
                    continue;
                }
                let at = f.strip_prefix(&root).unwrap_or(&f).display().to_string();
                seen.entry(d.name).or_default().push(at);
            }
        }
    }
    assert!(files_read > 100, "read only {files_read} source files: is the workspace layout as expected?");
    let clashes: Vec<String> =
        seen.iter().filter(|(_, at)| at.len() > 1).map(|(name, at)| format!("{name}: {}", at.join(", "))).collect();
    assert!(clashes.is_empty(), "public type names declared more than once:\n{}", clashes.join("\n"));
}
