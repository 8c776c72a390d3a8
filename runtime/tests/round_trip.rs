//! Host → device → host round trips for every element type.

mod common;

use common::*;
use half::{bf16, f16};
use kiln_runtime::{ElementType, NativeType, RuntimeError};

fn typed_round_trip<T: NativeType + PartialEq + std::fmt::Debug>(data: &[T], dims: &[usize]) -> anyhow::Result<()> {
    let client = cpu_client(1);
    let device = &client.devices()[0];
    let buffer = client.buffer_from_host(data, dims, device)?;
    assert_eq!(buffer.element_type(), T::TYPE);
    assert_eq!(buffer.dims(), dims);
    assert_eq!(buffer.device(), *device);
    assert!(buffer.on_device_size_in_bytes()? >= std::mem::size_of_val(data));
    assert_eq!(buffer.to_vec::<T>()?, data);
    Ok(())
}

#[test]
fn every_native_type_round_trips() -> anyhow::Result<()> {
    typed_round_trip(&[1.5f32, -2.25, 3.0, 1e-30, f32::MAX, -0.0], &[2, 3])?;
    typed_round_trip(&[1.5f64, -2.25, std::f64::consts::PI], &[3])?;
    typed_round_trip(&[f16::from_f32(0.5), f16::from_f32(-65504.0)], &[2])?;
    typed_round_trip(&[bf16::from_f32(1.0), bf16::from_f32(-3.0e38), bf16::from_f32(7.0), bf16::ONE], &[2, 2])?;
    typed_round_trip(&[i32::MIN, -1, 0, i32::MAX], &[4])?;
    typed_round_trip(&[i64::MIN, 42, i64::MAX], &[3, 1])?;
    typed_round_trip(&[-128i8, 0, 127], &[3])?;
    typed_round_trip(&[0u8, 1, 255], &[3])?;
    typed_round_trip(&[0u32, 7, u32::MAX], &[3])?;
    typed_round_trip(&[2.5f32], &[])?;
    Ok(())
}

#[test]
fn every_element_type_round_trips_as_bytes() -> anyhow::Result<()> {
    let client = cpu_client(1);
    let device = &client.devices()[0];
    let mut rng = XorShift::new(7);
    for ty in ElementType::ALL {
        let dims = [3usize, 2];
        let bytes: Vec<u8> = if ty == ElementType::Pred {
            (0..6).map(|i| (i % 2) as u8).collect()
        } else {
            (0..6 * ty.size_in_bytes()).map(|_| (rng.next_u64() % 200) as u8 + 1).collect()
        };
        let buffer = client.buffer_from_bytes(&bytes, ty, &dims, device)?;
        assert_eq!(buffer.element_type(), ty);
        assert_eq!(buffer.dims(), dims);
        assert_eq!(buffer.to_host_bytes()?, bytes, "{ty}");
    }
    Ok(())
}

#[test]
fn host_length_and_dtype_are_checked() -> anyhow::Result<()> {
    let client = cpu_client(1);
    let device = &client.devices()[0];
    let err = client.buffer_from_bytes(&[0u8; 7], ElementType::F32, &[2], device).unwrap_err();
    assert!(matches!(err, RuntimeError::HostDataLength { expected: 8, got: 7, .. }), "{err}");
    let err = client.buffer_from_host(&[1.0f32, 2.0], &[3], device).unwrap_err();
    assert!(matches!(err, RuntimeError::HostDataLength { expected: 12, got: 8, .. }), "{err}");
    let buffer = client.buffer_from_host(&[1.0f32, 2.0], &[2], device)?;
    let err = buffer.to_vec::<i32>().unwrap_err();
    assert!(
        matches!(err, RuntimeError::DTypeMismatch { requested: ElementType::S32, actual: ElementType::F32 }),
        "{err}"
    );
    Ok(())
}

#[test]
fn handles_are_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<kiln_runtime::Client>();
    assert_send_sync::<kiln_runtime::Device>();
    assert_send_sync::<kiln_runtime::Buffer>();
    assert_send_sync::<kiln_runtime::Executable>();
}

/// A device's memory limit is the allocator's, read through
/// `PJRT_Device_MemoryStats`: the CPU plugin keeps no allocator stats and
/// refuses the call, typed, rather than giving a made-up figure.
#[test]
fn the_cpu_plugin_refuses_device_memory_stats_typed() {
    let client = cpu_client(1);
    let e = client.devices()[0].memory_limit_bytes().unwrap_err();
    assert!(
        matches!(
            e,
            RuntimeError::Pjrt {
                function: "PJRT_Device_MemoryStats",
                code: kiln_runtime::PjrtErrorCode::Unimplemented,
                ..
            }
        ),
        "{e:?}"
    );
}
