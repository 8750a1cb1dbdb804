//! Generates, from `symbols.txt`, the linker version script (`RDMACM_1.0` … `RDMACM_1.3`, as
//! rdma-core's `librdmacm.map`), the stubs, failing with `ENOSYS`, of the entry points
//! softverbs does not implement, and the `.symver` directives that bind each implementation
//! `sv_<name>` to `<name>@@RDMACM_<v>` (rustc's own export list would otherwise leave the
//! plain names unversioned).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;

/// Version nodes in the order of the real map; each inherits the previous one.
const NODES: &[&str] = &["RDMACM_1.0", "RDMACM_1.1", "RDMACM_1.2", "RDMACM_1.3"];

fn main() {
    let dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets it"));
    println!("cargo:rerun-if-changed=symbols.txt");
    println!("cargo:rerun-if-changed=build.rs");
    let text = std::fs::read_to_string(dir.join("symbols.txt")).expect("symbols.txt");
    let mut by_node: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    let mut rust = String::new();
    let mut asm = Vec::new();
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let [name, node, kind] = line.split_whitespace().collect::<Vec<_>>()[..] else {
            panic!("symbols.txt: bad line `{line}`");
        };
        assert!(
            NODES.contains(&node),
            "symbols.txt: unknown node in `{line}`"
        );
        by_node.entry(node).or_default().push(name);
        let tag = node.replace(['.', '_'], "");
        if kind == "impl" {
            // The implementation may sit in another codegen unit, out of the assembler's
            // sight: bind the version to a jump defined right here.
            let tramp = format!("__sv_tramp_{tag}_{name}");
            asm.extend([
                ".text".to_string(),
                ".p2align 4".to_string(),
                format!(".globl {tramp}"),
                format!(".type {tramp},@function"),
                format!("{tramp}:"),
                format!("    jmp sv_{name}@PLT"),
                format!(".size {tramp}, .-{tramp}"),
                format!(".symver {tramp}, {name}@@{node}"),
            ]);
            continue;
        }
        let (ret, value) = match kind {
            "neg" => ("::core::ffi::c_int", "-1"),
            "ssize" => ("isize", "-1"),
            "off" => ("i64", "-1"),
            "ptr" => ("*mut ::core::ffi::c_void", "::core::ptr::null_mut()"),
            _ => panic!("symbols.txt: bad kind in `{line}`"),
        };
        writeln!(
            rust,
            "/// Stub for `{name}@{node}`: not implemented by softverbs (`ENOSYS`).\n\
             #[unsafe(no_mangle)]\npub extern \"C\" fn sv_stub_{name}() -> {ret} {{\n    \
             crate::set_errno(libc::ENOSYS);\n    {value}\n}}"
        )
        .unwrap();
        asm.push(format!(".symver sv_stub_{name}, {name}@@{node}"));
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
    for (i, node) in NODES.iter().enumerate() {
        writeln!(map, "{node} {{\n  global:").unwrap();
        for n in by_node.get(node).map(Vec::as_slice).unwrap_or_default() {
            writeln!(map, "    {n};").unwrap();
        }
        if i == 0 {
            writeln!(map, "  local: *;\n}};").unwrap();
        } else {
            writeln!(map, "}} {};", NODES[i - 1]).unwrap();
        }
    }
    let map_path = out.join("librdmacm.map");
    std::fs::write(&map_path, map).expect("write map");
    println!(
        "cargo:rustc-cdylib-link-arg=-Wl,--version-script={}",
        map_path.display()
    );
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,librdmacm.so.1");
}
