//! Every `#[repr(C)]` struct kiln declares has the size, `PJRT_STRUCT_SIZE`
//! and field offsets that the installed `pjrt_c_api.h` gives it.
//!
//! A C program printing `sizeof`/`offsetof` for each declared field is
//! generated, compiled with `cc` against the header shipped with the CPU
//! plugin, run, and compared line by line with Rust's values.

mod common;

use std::fmt::Write as _;
use std::process::Command;

use kiln_runtime::pjrt::declared_layouts;

#[test]
fn declared_structs_match_installed_header() -> anyhow::Result<()> {
    let include = common::pjrt_header_dir();
    assert!(include.join("pjrt_c_api.h").is_file(), "no header in {}", include.display());

    let mut c = String::from("#include <stdio.h>\n#include <stddef.h>\n#include \"pjrt_c_api.h\"\nint main(void) {\n");
    let mut expected = String::new();
    for layout in declared_layouts() {
        let n = layout.name;
        writeln!(c, "  printf(\"{n} sizeof %zu\\n\", sizeof({n}));")?;
        writeln!(c, "  printf(\"{n} STRUCT_SIZE %zu\\n\", (size_t){n}_STRUCT_SIZE);")?;
        writeln!(expected, "{n} sizeof {}", layout.size)?;
        writeln!(expected, "{n} STRUCT_SIZE {}", layout.struct_size)?;
        for (field, offset) in layout.fields {
            writeln!(c, "  printf(\"{n}.{field} %zu\\n\", offsetof({n}, {field}));")?;
            writeln!(expected, "{n}.{field} {offset}")?;
        }
    }
    c.push_str("  return 0;\n}\n");

    let dir = tempfile::tempdir()?;
    let src = dir.path().join("layout.c");
    let exe = dir.path().join("layout");
    std::fs::write(&src, &c)?;
    let status = Command::new("cc").arg("-std=c11").arg("-I").arg(&include).arg(&src).arg("-o").arg(&exe).status()?;
    assert!(status.success(), "cc failed on the generated layout program");
    let out = Command::new(&exe).output()?;
    assert!(out.status.success());
    let actual = String::from_utf8(out.stdout)?;

    let mismatches: Vec<String> = expected
        .lines()
        .zip(actual.lines())
        .filter(|(e, a)| e != a)
        .map(|(e, a)| format!("rust `{e}` vs header `{a}`"))
        .collect();
    assert_eq!(expected.lines().count(), actual.lines().count());
    assert!(mismatches.is_empty(), "layout mismatches:\n{}", mismatches.join("\n"));
    // Sanity: the comparison covered the whole function table.
    assert!(declared_layouts().iter().any(|l| l.name == "PJRT_Api" && l.fields.len() > 100));
    Ok(())
}
