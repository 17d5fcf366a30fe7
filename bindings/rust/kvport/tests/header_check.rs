// SPDX-License-Identifier: Apache-2.0
//! Checks the hand-written declarations in src/ffi.rs against the C header
//! kvport/kvport.h. It compares:
//!
//! - functions: the same set of names on both sides; per function the
//!   return type and the number and types of the parameters (C types mapped
//!   to Rust: `uint32_t` -> `u32`, `size_t` -> `usize`, `int` -> `c_int`,
//!   `int32_t` -> `i32`, `bool` -> `bool`, `char` -> `c_char`, `void` ->
//!   `c_void`, C enums -> their `c_int` alias of the same name, handles and
//!   structs by name, `const T*` -> `*const T`, `T*` -> `*mut T`, nested);
//! - structs: field names, order and types (`typedef struct x { ... } x;`
//!   with fields, not the opaque handles); an array field `T name[N]` is
//!   `[T; N]`, N a number or a `#define`d constant, compared by value;
//! - enum constants: every `KVPORT_*` enumerator's value is a `pub const` of
//!   the same value and the enum's alias type;
//! - integer constants: every `#define KVPORT_* <integer>` is a `pub const`
//!   of the same value (any integer type).
//!
//! The header is the one build.rs found (`KVPORT_HEADER` at compile time):
//! `$KVPORT_C_INCLUDE_DIR/kvport/kvport.h` when that is set, else the
//! installed one in pkg-config's include directory, else the source tree's
//! bindings/c/include/kvport/kvport.h.

use std::collections::BTreeMap;
use std::fs;
use std::path::PathBuf;

fn header_path() -> PathBuf {
    let header = env!("KVPORT_HEADER");
    assert!(
        !header.is_empty(),
        "build.rs found no kvport/kvport.h: set KVPORT_C_INCLUDE_DIR, or PKG_CONFIG_PATH to an \
         installed kvport's <libdir>/pkgconfig"
    );
    PathBuf::from(header)
}

/// Removes /* */ and // comments.
fn strip_comments(src: &str) -> String {
    let mut out = String::with_capacity(src.len());
    let b = src.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'/' && i + 1 < b.len() && b[i + 1] == b'*' {
            let end = src[i + 2..].find("*/").expect("unterminated comment");
            i += 2 + end + 2;
            out.push(' ');
        } else if b[i] == b'/' && i + 1 < b.len() && b[i + 1] == b'/' {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else {
            out.push(b[i] as char);
            i += 1;
        }
    }
    out
}

fn is_ident_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Splits C type text into identifiers and '*'.
fn c_tokens(text: &str) -> Vec<String> {
    let mut tokens = Vec::new();
    let mut cur = String::new();
    for c in text.chars() {
        if is_ident_char(c) {
            cur.push(c);
        } else {
            if !cur.is_empty() {
                tokens.push(std::mem::take(&mut cur));
            }
            if c == '*' {
                tokens.push("*".to_string());
            }
        }
    }
    if !cur.is_empty() {
        tokens.push(cur);
    }
    tokens
}

fn c_base_to_rust(base: &str) -> String {
    match base {
        "uint8_t" => "u8",
        "uint32_t" => "u32",
        "uint64_t" => "u64",
        "int32_t" => "i32",
        "int64_t" => "i64",
        "size_t" => "usize",
        "int" => "c_int",
        "bool" => "bool",
        "char" => "c_char",
        "void" => "c_void",
        "double" => "f64",
        other => other, // kvport_* typedefs keep their names
    }
    .to_string()
}

/// A C type (tokens, without the declarator name) as the Rust type text.
fn c_type_to_rust(tokens: &[String]) -> String {
    // [const] base [const] (* [const])*: a `const` qualifies what is to its
    // left (or the base when first), so it makes the NEXT '*' a pointer to
    // const; a const after the last '*' (the parameter itself) is dropped.
    let mut pending_const = false;
    let mut base: Option<&str> = None;
    let mut stars: Vec<bool> = Vec::new(); // per '*': does it point to const
    for t in tokens {
        match t.as_str() {
            "const" => pending_const = true,
            "*" => {
                stars.push(pending_const);
                pending_const = false;
            }
            "struct" | "enum" => {}
            other => {
                assert!(base.is_none(), "two base types in {:?}", tokens);
                base = Some(other);
            }
        }
    }
    let mut ty = c_base_to_rust(base.unwrap_or_else(|| panic!("no base type in {:?}", tokens)));
    for pointee_const in stars {
        ty = format!("*{} {}", if pointee_const { "const" } else { "mut" }, ty);
    }
    ty
}

#[derive(Debug, PartialEq)]
struct Func {
    ret: String,
    params: Vec<String>,
}

/// `KVPORT_API <ret> <name>(<params>);` from the header.
fn header_functions(header: &str) -> BTreeMap<String, Func> {
    let mut out = BTreeMap::new();
    for stmt in header.split(';') {
        let stmt = stmt.trim();
        let pos = match stmt.find("KVPORT_API ") {
            Some(p) => p,
            _ => continue,
        };
        let decl = &stmt[pos + "KVPORT_API ".len()..];
        let open = decl.find('(').expect("( in a prototype");
        let close = decl.rfind(')').expect(") in a prototype");
        let head = c_tokens(&decl[..open]);
        let name = head.last().unwrap().clone();
        let ret_tokens = &head[..head.len() - 1];
        let ret = if ret_tokens.len() == 1 && ret_tokens[0] == "void" {
            String::new()
        } else {
            c_type_to_rust(ret_tokens)
        };
        let mut params = Vec::new();
        let plist = decl[open + 1..close].trim();
        if plist != "void" && !plist.is_empty() {
            for p in plist.split(',') {
                let toks = c_tokens(p);
                // The last identifier is the parameter's name.
                assert!(toks.len() >= 2 && toks.last().unwrap() != "*", "unnamed parameter in {}: {:?}", name, p);
                params.push(c_type_to_rust(&toks[..toks.len() - 1]));
            }
        }
        assert!(out.insert(name.clone(), Func { ret, params }).is_none(), "{} twice", name);
    }
    out
}

/// A C or Rust integer literal: decimal or 0x hex, with an optional `u`
/// suffix (C) and `_` separators (Rust).
fn parse_int(text: &str) -> Option<i64> {
    let t = text.trim().trim_end_matches(|c| c == 'u' || c == 'U').replace('_', "");
    match t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        Some(hex) => i64::from_str_radix(hex, 16).ok(),
        None => t.parse().ok(),
    }
}

/// `#define KVPORT_NAME <integer>` lines of the raw header (comments out).
fn header_defines(header_src: &str) -> BTreeMap<String, i64> {
    let mut out = BTreeMap::new();
    for line in strip_comments(header_src).lines() {
        let rest = match line.trim().strip_prefix("#define ") {
            Some(r) => r.trim(),
            None => continue,
        };
        let (name, value) = match rest.split_once(char::is_whitespace) {
            Some(nv) => nv,
            None => continue, // an include guard
        };
        if let (true, Some(v)) = (name.starts_with("KVPORT_"), parse_int(value)) {
            out.insert(name.to_string(), v);
        }
    }
    out
}

/// `[T; N]` with N resolved through `consts` when it is a name (left as
/// written when it is no known constant: the field then differs).
fn array_type(elem: &str, dim: &str, consts: &BTreeMap<String, i64>) -> String {
    let dim = dim.trim();
    match parse_int(dim).or_else(|| consts.get(dim).copied()) {
        Some(n) => format!("[{}; {}]", elem, n),
        None => format!("[{}; {}]", elem, dim),
    }
}

/// `typedef struct name { fields } name;` (not the opaque handles).
fn header_structs(header: &str, defines: &BTreeMap<String, i64>) -> BTreeMap<String, Vec<(String, String)>> {
    let mut out = BTreeMap::new();
    let mut rest = header;
    while let Some(pos) = rest.find("typedef struct ") {
        rest = &rest[pos + "typedef struct ".len()..];
        let brace = rest.find('{');
        let semi = rest.find(';').unwrap();
        let brace = match brace {
            Some(b) if b < semi => b,
            _ => continue, // typedef struct x x;  (opaque)
        };
        let name = rest[..brace].trim().to_string();
        let end = rest.find('}').unwrap();
        let mut fields = Vec::new();
        for f in rest[brace + 1..end].split(';') {
            // `T name[N]`: the declarator before '[', the length inside.
            let (decl, dim) = match f.split_once('[') {
                Some((d, n)) => (d, Some(n.trim_end().trim_end_matches(']'))),
                None => (f, None),
            };
            let toks = c_tokens(decl);
            if toks.is_empty() {
                continue;
            }
            let fname = toks.last().unwrap().clone();
            let ty = c_type_to_rust(&toks[..toks.len() - 1]);
            let ty = match dim {
                Some(n) => array_type(&ty, n, defines),
                None => ty,
            };
            fields.push((fname, ty));
        }
        out.insert(name, fields);
        rest = &rest[end..];
    }
    out
}

/// `typedef enum name { A = 0, ... } name;`: enumerator -> (enum, value).
fn header_enums(header: &str) -> BTreeMap<String, (String, i64)> {
    let mut out = BTreeMap::new();
    let mut rest = header;
    while let Some(pos) = rest.find("typedef enum ") {
        rest = &rest[pos + "typedef enum ".len()..];
        let brace = rest.find('{').unwrap();
        let name = rest[..brace].trim().to_string();
        let end = rest.find('}').unwrap();
        for e in rest[brace + 1..end].split(',') {
            let e = e.trim();
            if e.is_empty() {
                continue;
            }
            let (k, v) = e.split_once('=').expect("every kvport enumerator has an explicit value");
            out.insert(k.trim().to_string(), (name.clone(), v.trim().parse().unwrap()));
        }
        rest = &rest[end..];
    }
    out
}

/// Normalizes Rust type text (paths dropped, single spaces): `*mut *const u32`.
fn rust_type(text: &str) -> String {
    let t = text.replace("std::os::raw::", "").replace("std::ffi::", "").replace("ffi::", "");
    t.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Splits a parameter list at top-level commas.
fn split_params(list: &str) -> Vec<String> {
    list.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect()
}

fn ffi_functions(src: &str) -> BTreeMap<String, Func> {
    let start = src.find("extern \"C\" {").expect("extern \"C\" block in ffi.rs");
    let body = &src[start..];
    let mut out = BTreeMap::new();
    for stmt in body.split(';') {
        let pos = match stmt.find("pub fn ") {
            Some(p) => p,
            None => continue,
        };
        let decl = &stmt[pos + "pub fn ".len()..];
        let open = decl.find('(').unwrap();
        let close = decl.rfind(')').unwrap();
        let name = decl[..open].trim().to_string();
        let params = split_params(&decl[open + 1..close])
            .iter()
            .map(|p| {
                let (_, ty) = p.split_once(':').unwrap_or_else(|| panic!("{}: parameter {:?}", name, p));
                rust_type(ty)
            })
            .collect();
        let after = decl[close + 1..].trim();
        let ret = match after.strip_prefix("->") {
            Some(r) => rust_type(r),
            None => String::new(),
        };
        assert!(out.insert(name.clone(), Func { ret, params }).is_none(), "{} twice", name);
    }
    out
}

fn ffi_structs(src: &str, consts: &BTreeMap<String, i64>) -> BTreeMap<String, Vec<(String, String)>> {
    let mut out = BTreeMap::new();
    let mut rest = src;
    while let Some(pos) = rest.find("pub struct ") {
        rest = &rest[pos + "pub struct ".len()..];
        let brace = rest.find('{').unwrap();
        let name = rest[..brace].trim().to_string();
        let end = rest.find('}').unwrap();
        let mut fields = Vec::new();
        for f in rest[brace + 1..end].split(',') {
            let f = f.trim();
            if f.is_empty() {
                continue;
            }
            let f = f.strip_prefix("pub ").unwrap_or(f);
            let (n, ty) = f.split_once(':').unwrap();
            let ty = rust_type(ty);
            // `[T; N]`: N resolved, as on the header's side.
            let ty = match ty.strip_prefix('[').and_then(|t| t.strip_suffix(']')) {
                Some(inner) => {
                    let (elem, dim) = inner.split_once(';').expect("[T; N]");
                    array_type(elem.trim(), dim, consts)
                }
                None => ty,
            };
            fields.push((n.trim().to_string(), ty));
        }
        // Opaque handles (`_opaque: [u8; 0]`) are not compared.
        if !(fields.len() == 1 && fields[0].0 == "_opaque") {
            out.insert(name, fields);
        }
        rest = &rest[end..];
    }
    out
}

/// `pub const NAME: alias = value;`
fn ffi_consts(src: &str) -> BTreeMap<String, (String, i64)> {
    let mut out = BTreeMap::new();
    for line in src.lines() {
        let line = line.trim();
        if let Some(rest) = line.strip_prefix("pub const ") {
            let (name, rest) = rest.split_once(':').unwrap();
            let (ty, value) = rest.split_once('=').unwrap();
            let value = value.trim().trim_end_matches(';').trim();
            let value = parse_int(value).unwrap_or_else(|| panic!("{}: value {:?}", name, value));
            out.insert(name.trim().to_string(), (ty.trim().to_string(), value));
        }
    }
    out
}

/// `pub type kvport_status = c_int;` aliases.
fn ffi_aliases(src: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for line in src.lines() {
        if let Some(rest) = line.trim().strip_prefix("pub type ") {
            let (name, ty) = rest.split_once('=').unwrap();
            out.insert(name.trim().to_string(), ty.trim().trim_end_matches(';').trim().to_string());
        }
    }
    out
}

/// Every difference between the header and ffi.rs, as lines.
fn compare(header_src: &str, ffi_src: &str) -> Vec<String> {
    // Comments and preprocessor lines out.
    let header: String = strip_comments(header_src)
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .collect::<Vec<_>>()
        .join("\n");
    let ffi = strip_comments(ffi_src);
    let defines = header_defines(header_src);
    let rc = ffi_consts(&ffi);
    let rust_values: BTreeMap<String, i64> = rc.iter().map(|(k, (_, v))| (k.clone(), *v)).collect();
    let mut problems = Vec::new();

    let hf = header_functions(&header);
    let rf = ffi_functions(&ffi);
    assert!(hf.len() > 50, "parsed only {} functions from the header", hf.len());
    for (name, h) in &hf {
        match rf.get(name) {
            None => problems.push(format!("{}: in the header, not declared in ffi.rs", name)),
            Some(r) => {
                if h.params.len() != r.params.len() {
                    problems.push(format!(
                        "{}: {} parameters in the header, {} in ffi.rs",
                        name,
                        h.params.len(),
                        r.params.len()
                    ));
                } else {
                    for (i, (hp, rp)) in h.params.iter().zip(&r.params).enumerate() {
                        if hp != rp {
                            problems.push(format!("{}: parameter {}: header `{}`, ffi.rs `{}`", name, i + 1, hp, rp));
                        }
                    }
                }
                if h.ret != r.ret {
                    problems.push(format!("{}: returns header `{}`, ffi.rs `{}`", name, h.ret, r.ret));
                }
            }
        }
    }
    for name in rf.keys() {
        if !hf.contains_key(name) {
            problems.push(format!("{}: declared in ffi.rs, not in the header", name));
        }
    }

    let hs = header_structs(&header, &defines);
    let rs = ffi_structs(&ffi, &rust_values);
    assert!(hs.len() >= 6, "parsed only {} structs from the header", hs.len());
    for (name, fields) in &hs {
        match rs.get(name) {
            None => problems.push(format!("struct {}: not in ffi.rs", name)),
            Some(r) if r != fields => {
                problems.push(format!("struct {}: header {:?}, ffi.rs {:?}", name, fields, r))
            }
            Some(_) => {}
        }
    }
    for name in rs.keys() {
        if !hs.contains_key(name) {
            problems.push(format!("struct {}: in ffi.rs, not in the header", name));
        }
    }

    let he = header_enums(&header);
    let aliases = ffi_aliases(&ffi);
    assert!(he.len() >= 20, "parsed only {} enumerators from the header", he.len());
    for (name, (enum_name, value)) in &he {
        match rc.get(name) {
            None => problems.push(format!("{}: enumerator of {} not in ffi.rs", name, enum_name)),
            Some((ty, v)) => {
                if v != value {
                    problems.push(format!("{}: header {}, ffi.rs {}", name, value, v));
                }
                if ty != enum_name {
                    problems.push(format!("{}: ffi.rs type {}, header enum {}", name, ty, enum_name));
                }
            }
        }
        if aliases.get(enum_name).map(String::as_str) != Some("c_int") {
            problems.push(format!("enum {}: ffi.rs needs `pub type {} = c_int;`", enum_name, enum_name));
        }
    }
    for (name, value) in &defines {
        match rc.get(name) {
            None => problems.push(format!("{}: #define of the header not in ffi.rs", name)),
            Some((_, v)) if v != value => problems.push(format!("{}: header {}, ffi.rs {}", name, value, v)),
            Some(_) => {}
        }
    }
    for name in rc.keys() {
        if !he.contains_key(name) && !defines.contains_key(name) {
            problems.push(format!("{}: constant in ffi.rs, not in the header", name));
        }
    }
    problems.sort();
    problems.dedup();
    problems
}

#[test]
fn ffi_matches_the_header() {
    let path = header_path();
    let header = fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {}", path.display(), e));
    let ffi = include_str!("../src/ffi.rs");
    let problems = compare(&header, ffi);
    assert!(
        problems.is_empty(),
        "src/ffi.rs differs from {}:\n  {}",
        path.display(),
        problems.join("\n  ")
    );
}

#[test]
fn the_check_sees_a_mismatch() {
    let header = fs::read_to_string(header_path()).unwrap();
    let ffi = include_str!("../src/ffi.rs");
    // The parser's reading of one prototype with nested and const pointers.
    let stripped: String = strip_comments(&header).lines().filter(|l| !l.trim_start().starts_with('#')).collect::<Vec<_>>().join("\n");
    let f = &header_functions(&stripped)["kvport_block_table_blocks"];
    assert_eq!(f.params, vec!["*const kvport_block_table", "*mut *const u32", "*mut usize"]);
    assert_eq!(f.ret, "kvport_status");
    // A parameter type, a parameter count, a missing function, a struct
    // field and an enumerator value, each changed in a copy of ffi.rs.
    let cases = [
        (
            "pub fn kvport_cache_inc_ref(cache: *mut kvport_cache, block: u32)",
            "pub fn kvport_cache_inc_ref(cache: *mut kvport_cache, block: u64)",
            "kvport_cache_inc_ref: parameter 2",
        ),
        (
            "pub fn kvport_cache_synchronize(cache: *mut kvport_cache)",
            "pub fn kvport_cache_synchronize(cache: *mut kvport_cache, extra: usize)",
            "kvport_cache_synchronize: 1 parameters in the header, 2",
        ),
        (
            "pub fn kvport_clear_last_error();",
            "",
            "kvport_clear_last_error: in the header, not declared",
        ),
        (
            "pub fn kvport_cache_ref_count(cache: *const kvport_cache",
            "pub fn kvport_cache_ref_count(cache: *mut kvport_cache",
            "kvport_cache_ref_count: parameter 1",
        ),
        ("pub head_dim_v: usize,", "pub head_dim_v: u32,", "struct kvport_config"),
        (
            "pub const KVPORT_ERR_UNKNOWN: kvport_status = 10;",
            "pub const KVPORT_ERR_UNKNOWN: kvport_status = 11;",
            "KVPORT_ERR_UNKNOWN: header 10, ffi.rs 11",
        ),
        (
            "pub const KVPORT_NULL_BLOCK: u32 = 0xFFFFFFFF;",
            "pub const KVPORT_NULL_BLOCK: u32 = 0xFFFFFFFE;",
            "KVPORT_NULL_BLOCK: header 4294967295, ffi.rs 4294967294",
        ),
        ("pub const KVPORT_STATE_MAX_DIMS: usize = 8;", "", "KVPORT_STATE_MAX_DIMS: #define of the header not in ffi.rs"),
        ("pub shape: [usize; KVPORT_STATE_MAX_DIMS],", "pub shape: [usize; 4],", "struct kvport_state_tensor"),
        ("pub ratio_to_all_full: f64,", "pub ratio_to_all_full: f32,", "struct kvport_plan"),
    ];
    for (from, to, expected) in cases.iter() {
        assert!(ffi.contains(from), "test case out of date: {:?}", from);
        let changed = ffi.replacen(from, to, 1);
        let problems = compare(&header, &changed);
        assert!(
            problems.iter().any(|p| p.contains(expected)),
            "changing {:?} was not reported as {:?}: {:?}",
            from,
            expected,
            problems
        );
    }
}
