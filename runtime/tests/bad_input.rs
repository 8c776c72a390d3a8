//! Bad plugins, bad programs and bad arguments are typed errors, never crashes.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;
use kiln_runtime::plugin::{find_plugin, PjrtDevice};
use kiln_runtime::{ArgType, Client, ClientOptions, CompileOptions, ElementType, ExecArg, PjrtErrorCode, RuntimeError};

fn client_for(path: &Path) -> RuntimeError {
    Client::new(&ClientOptions { plugin: Some(path.to_path_buf()), cpu_device_count: None, ..ClientOptions::default() })
        .expect_err("loading must fail")
}

fn build_shared_library(dir: &Path, name: &str, source: &str) -> PathBuf {
    let src = dir.join(format!("{name}.c"));
    let lib = dir.join(format!("{name}.so"));
    std::fs::write(&src, source).expect("write C source");
    let status = Command::new("cc").args(["-shared", "-fPIC", "-o"]).arg(&lib).arg(&src).status().expect("run cc");
    assert!(status.success(), "cc failed for {name}");
    lib
}

#[test]
fn missing_plugin_lists_paths_and_install_command() {
    let empty = tempfile::tempdir().unwrap();
    let err = find_plugin(PjrtDevice::Cpu, &[empty.path().to_path_buf()]).unwrap_err();
    let RuntimeError::PluginNotFound { device, searched, install_hint } = &err else { panic!("{err}") };
    assert_eq!(device, "CPU");
    assert!(searched.contains(&empty.path().join("xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so")));
    assert_eq!(install_hint, "python3 -m pip install xla-cpu-pjrt==0.0.1");
    let text = err.to_string();
    assert!(text.contains("xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so") && text.contains("pip install"), "{text}");

    let err = find_plugin(PjrtDevice::Cuda, &[empty.path().to_path_buf()]).unwrap_err();
    assert!(err.to_string().contains("python3 -m pip install jax-cuda13-pjrt"), "{err}");
}

#[test]
fn text_file_is_not_a_library() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("not_a_plugin.so");
    std::fs::write(&path, "hello").unwrap();
    let err = client_for(&path);
    assert!(matches!(&err, RuntimeError::PluginLoad { path: p, .. } if *p == path), "{err}");
}

#[test]
fn library_without_get_pjrt_api_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let lib = build_shared_library(dir.path(), "nothing", "int kiln_unrelated(void) { return 1; }\n");
    let err = client_for(&lib);
    assert!(matches!(err, RuntimeError::MissingSymbol { symbol: "GetPjrtApi", .. }), "{err}");
}

#[test]
fn old_api_version_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let source = r#"
#include <stddef.h>
struct version { size_t struct_size; void* ext; int major_version; int minor_version; };
struct api { size_t struct_size; void* ext; struct version v; void* fns[8]; };
static struct api table = { sizeof(struct api), 0, { sizeof(struct version), 0, 0, 54 }, {0} };
const struct api* GetPjrtApi(void) { return &table; }
"#;
    let lib = build_shared_library(dir.path(), "old_pjrt", source);
    let err = client_for(&lib);
    assert!(matches!(err, RuntimeError::ApiTooOld { found: (0, 54), required: (0, 81), .. }), "{err}");
    assert!(err.to_string().contains("0.54") && err.to_string().contains("0.81"), "{err}");
}

#[test]
fn unparseable_stablehlo_keeps_xla_message() {
    let client = cpu_client(1);
    let program = r#"
func.func public @main(%x: tensor<2xf32>) -> tensor<2xf32> {
  %0 = stablehlo.frobnicate %x : tensor<2xf32>
  return %0 : tensor<2xf32>
}
"#;
    let err = client.compile(program, &CompileOptions::default()).unwrap_err();
    let RuntimeError::Pjrt { function, code, message } = &err else { panic!("{err}") };
    assert_eq!(*function, "PJRT_Client_Compile");
    assert_ne!(*code, PjrtErrorCode::Ok);
    assert!(message.contains("frobnicate"), "XLA's message should be kept: {message}");

    let err = client.compile("func.func public @not_main() { return }", &CompileOptions::default()).unwrap_err();
    assert!(matches!(err, RuntimeError::Signature { .. }), "{err}");
}

#[test]
fn wrong_arguments_are_caught_before_the_plugin() -> anyhow::Result<()> {
    let client = cpu_client(1);
    let device = &client.devices()[0];
    let exe = client.compile(DOT_TANH, &CompileOptions::default())?;
    let x = client.buffer_from_host(&[1.0f32; 12], &[4, 3], device)?;
    let w = client.buffer_from_host(&[1.0f32; 15], &[3, 5], device)?;

    let err = exe.execute(&[ExecArg::Borrowed(&x)]).unwrap_err();
    assert!(matches!(err, RuntimeError::ArgCount { expected: 2, got: 1 }), "{err}");

    let w_f64 = client.buffer_from_host(&[1.0f64; 15], &[3, 5], device)?;
    let err = exe.execute(&[ExecArg::Borrowed(&x), ExecArg::Borrowed(&w_f64)]).unwrap_err();
    assert!(
        matches!(&err, RuntimeError::ArgType { index: 1, expected, got }
            if *expected == ArgType::new(ElementType::F32, &[3, 5]) && *got == ArgType::new(ElementType::F64, &[3, 5])),
        "{err}"
    );
    assert_eq!(err.to_string(), "argument 1: expected tensor<3x5xf32>, got tensor<3x5xf64>");

    let w_shape = client.buffer_from_host(&[1.0f32; 15], &[5, 3], device)?;
    let err = exe.execute(&[ExecArg::Borrowed(&x), ExecArg::Borrowed(&w_shape)]).unwrap_err();
    assert!(matches!(err, RuntimeError::ArgType { index: 1, .. }), "{err}");

    let other = cpu_client(1);
    let foreign = other.buffer_from_host(&[1.0f32; 15], &[3, 5], &other.devices()[0])?;
    let err = exe.execute(&[ExecArg::Borrowed(&x), ExecArg::Borrowed(&foreign)]).unwrap_err();
    assert!(matches!(err, RuntimeError::ForeignBuffer { index: 1 }), "{err}");
    let err = client.buffer_from_host(&[1.0f32], &[1], &other.devices()[0]).unwrap_err();
    assert!(matches!(err, RuntimeError::ForeignDevice { .. }), "{err}");

    // Still usable after all of that.
    let out = exe.execute(&[ExecArg::Borrowed(&x), ExecArg::Borrowed(&w)])?;
    let err = max_rel_err(&out[0].to_vec::<f32>()?, &[3.0f64.tanh(); 20], &[3.0; 20]);
    assert!(err < 1e-5, "max relative error {err}");
    Ok(())
}

#[test]
fn wrong_device_is_caught() -> anyhow::Result<()> {
    let client = cpu_client(2);
    let devices = client.devices();
    let exe = client.compile(DOT_TANH, &CompileOptions::default())?;
    let x = client.buffer_from_host(&[1.0f32; 12], &[4, 3], &devices[1])?;
    let w = client.buffer_from_host(&[1.0f32; 15], &[3, 5], &devices[0])?;
    let err = exe.execute(&[ExecArg::Borrowed(&x), ExecArg::Borrowed(&w)]).unwrap_err();
    assert!(matches!(err, RuntimeError::WrongDevice { replica: 0, index: 0, .. }), "{err}");
    Ok(())
}

#[test]
fn bad_compile_options_are_typed() {
    let client = cpu_client(1);
    let opts = CompileOptions { num_replicas: 0, ..Default::default() };
    let err = client.compile(DOT_TANH, &opts).unwrap_err();
    assert!(matches!(err, RuntimeError::CompileOptions { .. }), "{err}");
}
