//! Generates, from `symbols.txt`, the linker version script (`IBVERBS_1.0` …,
//! `IBVERBS_PRIVATE_34` and softverbs' own `SOFTVERBS_1.0`), the stubs for entry points softverbs does not implement, and the
//! `.symver` directives that bind each implementation to its versioned name.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;

/// Version nodes in the order of the real library's map; each inherits the previous one.
const NODES: &[&str] = &[
    "IBVERBS_1.0",
    "IBVERBS_1.1",
    "IBVERBS_1.5",
    "IBVERBS_1.6",
    "IBVERBS_1.7",
    "IBVERBS_1.8",
    "IBVERBS_1.9",
    "IBVERBS_1.10",
    "IBVERBS_1.11",
    "IBVERBS_1.12",
    "IBVERBS_1.13",
    "IBVERBS_1.14",
];
const PRIVATE: &str = "IBVERBS_PRIVATE_34";
/// softverbs' own extensions (`softverbs/verbs_ext.h`): a node of their own that inherits
/// nothing, so no rdma-core symbol version ever names them.
const SOFTVERBS: &str = "SOFTVERBS_1.0";

fn main() {
    let dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets it"));
    println!("cargo:rerun-if-changed=symbols.txt");
    println!("cargo:rerun-if-changed=build.rs");
    let text = std::fs::read_to_string(dir.join("symbols.txt")).expect("symbols.txt");
    let mut by_node: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    let mut rust = String::new();
    let mut asm = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let f: Vec<&str> = line.split_whitespace().collect();
        let (name, node, old, kind) = match f.as_slice() {
            [n, v, k] => (*n, *v, false, *k),
            [n, v, "old", k] => (*n, *v, true, *k),
            _ => panic!("symbols.txt: bad line `{line}`"),
        };
        assert!(
            NODES.contains(&node) || node == PRIVATE || node == SOFTVERBS,
            "symbols.txt: unknown version node `{node}` in `{line}`"
        );
        by_node.entry(node).or_default().push(name);
        let tag = node.replace(['.', '_'], "");
        let local = match kind {
            "impl" => format!("sv_{name}"),
            _ => format!("sv_stub_{tag}_{name}"),
        };
        let body = match kind {
            "impl" => None,
            "int" => Some((
                "-> ::core::ffi::c_int",
                "crate::set_errno(libc::ENOSYS);\n    libc::ENOSYS",
            )),
            "neg" => Some((
                "-> ::core::ffi::c_int",
                "crate::set_errno(libc::ENOSYS);\n    -1",
            )),
            "ssize" => Some((
                "-> isize",
                "crate::set_errno(libc::ENOSYS);\n    -(libc::ENOSYS as isize)",
            )),
            "ptr" => Some((
                "-> *mut ::core::ffi::c_void",
                "crate::set_errno(libc::ENOSYS);\n    ::core::ptr::null_mut()",
            )),
            "str" => Some(("-> *const ::core::ffi::c_char", "c\"unknown\".as_ptr()")),
            "void" => Some(("", "")),
            "data" => None,
            _ => panic!("symbols.txt: bad kind `{kind}`"),
        };
        if kind == "data" {
            writeln!(
                rust,
                "#[unsafe(no_mangle)]\n#[used]\npub static {local}: u8 = 0;"
            )
            .unwrap();
        } else if let Some((ret, body)) = body {
            writeln!(
                rust,
                "/// Stub for `{name}@{node}`: not implemented by softverbs.\n\
                 #[unsafe(no_mangle)]\npub extern \"C\" fn {local}() {ret} {{\n    {body}\n}}"
            )
            .unwrap();
        }
        let at = if old { "@" } else { "@@" };
        if kind == "impl" {
            // The implementation lives in another module, maybe another codegen unit, where
            // the assembler cannot see it: bind the version to a jump defined right here.
            let tramp = format!("__sv_tramp_{tag}_{name}");
            for l in [
                ".text".to_string(),
                ".p2align 4".to_string(),
                format!(".globl {tramp}"),
                format!(".type {tramp},@function"),
                format!("{tramp}:"),
                format!("    jmp {local}@PLT"),
                format!(".size {tramp}, .-{tramp}"),
                format!(".symver {tramp}, {name}{at}{node}"),
            ] {
                asm.push(l);
            }
        } else {
            asm.push(format!(".symver {local}, {name}{at}{node}"));
        }
    }
    writeln!(
        rust,
        "#[cfg(not(test))]\n::core::arch::global_asm!(\n{}\n);",
        asm.iter()
            .map(|l| format!("    \"{l}\","))
            .collect::<Vec<_>>()
            .join("\n")
    )
    .unwrap();
    std::fs::write(out.join("stubs.rs"), rust).expect("write stubs.rs");

    let mut map = String::new();
    let mut prev: Option<&str> = None;
    for node in NODES.iter().copied().chain([PRIVATE, SOFTVERBS]) {
        writeln!(map, "{node} {{\n  global:").unwrap();
        for n in by_node.get(node).map(Vec::as_slice).unwrap_or_default() {
            writeln!(map, "    {n};").unwrap();
        }
        if prev.is_none() {
            writeln!(map, "  local: *;").unwrap();
        }
        match prev {
            Some(p) if node != PRIVATE && node != SOFTVERBS => writeln!(map, "}} {p};").unwrap(),
            _ => writeln!(map, "}};").unwrap(),
        }
        prev = Some(node);
    }
    let map_path = out.join("libibverbs.map");
    std::fs::write(&map_path, map).expect("write map");
    println!(
        "cargo:rustc-cdylib-link-arg=-Wl,--version-script={}",
        map_path.display()
    );
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libibverbs.so.1");
}
