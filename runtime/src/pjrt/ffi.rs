//! Hand-written `#[repr(C)]` declarations of the subset of the PJRT C API
//! (`pjrt_c_api.h`, API 0.81) that kiln uses.
//!
//! Invariants:
//! - Every struct is declared field for field as in the 0.81 header, in the same
//!   order, with C-compatible types (C enums are `c_int`, so any value a newer
//!   plugin writes stays a valid Rust value). The `layout` test compiles a C
//!   program against the installed header and checks every size and offset.
//! - `struct_size` is set to `STRUCT_SIZE` (offset of our last field + its
//!   size, the header's `PJRT_STRUCT_SIZE`), never `size_of`, so trailing
//!   padding is never mistaken for a field a newer plugin knows about.
//! - The `PJRT_Api` table is append-only: a plugin built on a newer header
//!   (the CUDA plugin is 0.115) has a longer table whose prefix is ours.
#![allow(non_camel_case_types, non_snake_case, dead_code)]

use std::ffi::{c_char, c_int, c_void};

/// Layout of one declared struct, for the header-conformance test.
#[derive(Debug, Clone, Copy)]
pub struct StructLayout {
    /// The C name (`PJRT_Client_Create_Args`).
    pub name: &'static str,
    /// `size_of` of the Rust declaration.
    pub size: usize,
    /// The header's `PJRT_STRUCT_SIZE` (offset + size of the last field).
    pub struct_size: usize,
    /// `(C field name, Rust offset)` for every field.
    pub fields: &'static [(&'static str, usize)],
}

macro_rules! c_field_name {
    ($c:literal ; $f:ident) => {
        $c
    };
    (; $f:ident) => {
        stringify!($f)
    };
}

/// Declares a `#[repr(C)]` struct plus its `STRUCT_SIZE` and `LAYOUT`.
macro_rules! pjrt_struct {
    ($name:ident { $( $(#[c = $cname:literal])? $field:ident : $ty:ty ),* $(,)? }) => {
        #[repr(C)]
        #[derive(Clone, Copy)]
        pub struct $name { $( pub $field: $ty, )* }

        impl $name {
            const FIELD_TABLE: &'static [(&'static str, usize, usize)] = &[
                $( (c_field_name!($($cname)? ; $field),
                    core::mem::offset_of!($name, $field),
                    core::mem::size_of::<$ty>()), )*
            ];
            const FIELDS: &'static [(&'static str, usize)] = &[
                $( (c_field_name!($($cname)? ; $field), core::mem::offset_of!($name, $field)), )*
            ];
            /// The header's `PJRT_STRUCT_SIZE(name, last_field)`.
            pub const STRUCT_SIZE: usize = {
                let t = Self::FIELD_TABLE;
                t[t.len() - 1].1 + t[t.len() - 1].2
            };
            /// All fields zero (null pointers, zero sizes, `None` callbacks)
            /// with `struct_size` set: the starting point of every call.
            pub fn zeroed() -> Self {
                // SAFETY: every field is a raw pointer, integer, `bool`, a
                // `repr(C)` union of those, or `Option<fn>`; all-zero bytes are
                // a valid value for each (null, 0, false, None).
                let mut value: Self = unsafe { core::mem::zeroed() };
                value.struct_size = Self::STRUCT_SIZE;
                value
            }
            pub const LAYOUT: StructLayout = StructLayout {
                name: stringify!($name),
                size: core::mem::size_of::<$name>(),
                struct_size: Self::STRUCT_SIZE,
                fields: Self::FIELDS,
            };
        }
    };
}

// Opaque handles.
macro_rules! opaque {
    ($($name:ident),*) => { $( #[repr(C)] pub struct $name { _private: [u8; 0] } )* };
}
opaque!(
    PJRT_Error,
    PJRT_Event,
    PJRT_Client,
    PJRT_Device,
    PJRT_DeviceDescription,
    PJRT_Memory,
    PJRT_Executable,
    PJRT_LoadedExecutable,
    PJRT_Buffer,
    PJRT_SerializedExecutable,
    PJRT_ExecuteContext,
    PJRT_Buffer_MemoryLayout,
    PJRT_SendCallbackInfo,
    PJRT_RecvCallbackInfo
);

pub type Ext = *mut c_void; // PJRT_Extension_Base*
/// A PJRT entry point: `PJRT_Error* f(Args*)`.
pub type ApiFn<A> = Option<unsafe extern "C" fn(*mut A) -> *mut PJRT_Error>;
/// A PJRT entry point returning `void`.
pub type VoidFn<A> = Option<unsafe extern "C" fn(*mut A)>;
/// A table slot kiln does not call; only its position matters.
pub type Unused = Option<unsafe extern "C" fn()>;

// PJRT_NamedValue_Type values.
pub const PJRT_NAMED_VALUE_INT64: c_int = 1;
pub const PJRT_NAMED_VALUE_INT64_LIST: c_int = 2;
pub const PJRT_NAMED_VALUE_FLOAT: c_int = 3;
pub const PJRT_NAMED_VALUE_BOOL: c_int = 4;

/// `PJRT_CallbackError`: made by the plugin, handed to the key-value
/// callbacks (by pointer) so they can return a `PJRT_Error*` it owns.
pub type PJRT_CallbackError =
    Option<unsafe extern "C" fn(code: c_int, message: *const c_char, message_size: usize) -> *mut PJRT_Error>;
/// `PJRT_KeyValueGetCallback_ValueDeleter` (and the try-get one, same type).
pub type PJRT_KeyValue_ValueDeleter = Option<unsafe extern "C" fn(value: *mut c_char)>;

// PJRT_HostBufferSemantics values.
pub const PJRT_HOST_BUFFER_IMMUTABLE_UNTIL_TRANSFER_COMPLETES: c_int = 1;

pjrt_struct!(PJRT_Extension_Base { struct_size: usize, #[c = "type"] kind: u32, next: *const PJRT_Extension_Base });
pjrt_struct!(PJRT_Api_Version { struct_size: usize, extension_start: Ext, major_version: c_int, minor_version: c_int });

pjrt_struct!(PJRT_Error_Destroy_Args { struct_size: usize, extension_start: Ext, error: *mut PJRT_Error });
pjrt_struct!(PJRT_Error_Message_Args {
    struct_size: usize,
    extension_start: Ext,
    error: *const PJRT_Error,
    message: *const c_char,
    message_size: usize,
});
pjrt_struct!(PJRT_Error_GetCode_Args {
    struct_size: usize,
    extension_start: Ext,
    error: *const PJRT_Error,
    code: c_int,
});

// `PJRT_NamedValue`; the C anonymous union is represented by its widest member.
pjrt_struct!(PJRT_NamedValue {
    struct_size: usize,
    extension_start: Ext,
    name: *const c_char,
    name_size: usize,
    #[c = "type"]
    type_: c_int,
    #[c = "int64_value"]
    value: NamedValueUnion,
    value_size: usize,
});

#[repr(C)]
#[derive(Clone, Copy)]
pub union NamedValueUnion {
    pub string_value: *const c_char,
    pub int64_value: i64,
    pub int64_array_value: *const i64,
    pub float_value: f32,
    pub bool_value: bool,
}

pjrt_struct!(PJRT_Plugin_Initialize_Args { struct_size: usize, extension_start: Ext });

pjrt_struct!(PJRT_Event_Destroy_Args { struct_size: usize, extension_start: Ext, event: *mut PJRT_Event });
pjrt_struct!(PJRT_Event_Await_Args { struct_size: usize, extension_start: Ext, event: *mut PJRT_Event });
pjrt_struct!(PJRT_Event_IsReady_Args { struct_size: usize, extension_start: Ext, event: *mut PJRT_Event, is_ready: bool });

pjrt_struct!(PJRT_KeyValueGetCallback_Args {
    struct_size: usize,
    extension_start: Ext,
    key: *const c_char,
    key_size: usize,
    timeout_in_ms: c_int,
    callback_error: *mut PJRT_CallbackError,
    user_arg: *mut c_void,
    value: *mut c_char,
    value_size: usize,
    value_deleter_callback: PJRT_KeyValue_ValueDeleter,
});
pjrt_struct!(PJRT_KeyValueTryGetCallback_Args {
    struct_size: usize,
    extension_start: Ext,
    key: *const c_char,
    key_size: usize,
    callback_error: *mut PJRT_CallbackError,
    user_arg: *mut c_void,
    value: *mut c_char,
    value_size: usize,
    value_deleter_callback: PJRT_KeyValue_ValueDeleter,
});
pjrt_struct!(PJRT_KeyValuePutCallback_Args {
    struct_size: usize,
    extension_start: Ext,
    key: *const c_char,
    key_size: usize,
    value: *const c_char,
    value_size: usize,
    callback_error: *mut PJRT_CallbackError,
    user_arg: *mut c_void,
});
/// `PJRT_KeyValueGetCallback`.
pub type KvGetFn = Option<unsafe extern "C" fn(*mut PJRT_KeyValueGetCallback_Args) -> *mut PJRT_Error>;
/// `PJRT_KeyValueTryGetCallback`.
pub type KvTryGetFn = Option<unsafe extern "C" fn(*mut PJRT_KeyValueTryGetCallback_Args) -> *mut PJRT_Error>;
/// `PJRT_KeyValuePutCallback`.
pub type KvPutFn = Option<unsafe extern "C" fn(*mut PJRT_KeyValuePutCallback_Args) -> *mut PJRT_Error>;

pjrt_struct!(PJRT_Client_Create_Args {
    struct_size: usize,
    extension_start: Ext,
    create_options: *const PJRT_NamedValue,
    num_options: usize,
    kv_get_callback: KvGetFn,
    kv_get_user_arg: *mut c_void,
    kv_put_callback: KvPutFn,
    kv_put_user_arg: *mut c_void,
    client: *mut PJRT_Client,
    kv_try_get_callback: KvTryGetFn,
    kv_try_get_user_arg: *mut c_void,
});
pjrt_struct!(PJRT_Client_Destroy_Args { struct_size: usize, extension_start: Ext, client: *mut PJRT_Client });
pjrt_struct!(PJRT_Client_PlatformName_Args {
    struct_size: usize,
    extension_start: Ext,
    client: *mut PJRT_Client,
    platform_name: *const c_char,
    platform_name_size: usize,
});
pjrt_struct!(PJRT_Client_ProcessIndex_Args {
    struct_size: usize,
    extension_start: Ext,
    client: *mut PJRT_Client,
    process_index: c_int,
});
pjrt_struct!(PJRT_Client_Devices_Args {
    struct_size: usize,
    extension_start: Ext,
    client: *mut PJRT_Client,
    devices: *const *mut PJRT_Device,
    num_devices: usize,
});
pjrt_struct!(PJRT_DeviceDescription_ProcessIndex_Args {
    struct_size: usize,
    extension_start: Ext,
    device_description: *mut PJRT_DeviceDescription,
    process_index: c_int,
});
pjrt_struct!(PJRT_Client_AddressableDevices_Args {
    struct_size: usize,
    extension_start: Ext,
    client: *mut PJRT_Client,
    addressable_devices: *const *mut PJRT_Device,
    num_addressable_devices: usize,
});
pjrt_struct!(PJRT_Program {
    struct_size: usize,
    extension_start: Ext,
    code: *mut c_char,
    code_size: usize,
    format: *const c_char,
    format_size: usize,
});
pjrt_struct!(PJRT_Client_Compile_Args {
    struct_size: usize,
    extension_start: Ext,
    client: *mut PJRT_Client,
    program: *const PJRT_Program,
    compile_options: *const c_char,
    compile_options_size: usize,
    executable: *mut PJRT_LoadedExecutable,
});
pjrt_struct!(PJRT_Client_BufferFromHostBuffer_Args {
    struct_size: usize,
    extension_start: Ext,
    client: *mut PJRT_Client,
    data: *const c_void,
    #[c = "type"]
    type_: c_int,
    dims: *const i64,
    num_dims: usize,
    byte_strides: *const i64,
    num_byte_strides: usize,
    host_buffer_semantics: c_int,
    device: *mut PJRT_Device,
    memory: *mut PJRT_Memory,
    device_layout: *mut PJRT_Buffer_MemoryLayout,
    done_with_host_buffer: *mut PJRT_Event,
    buffer: *mut PJRT_Buffer,
});

pjrt_struct!(PJRT_DeviceDescription_Id_Args {
    struct_size: usize,
    extension_start: Ext,
    device_description: *mut PJRT_DeviceDescription,
    id: c_int,
});
pjrt_struct!(PJRT_DeviceDescription_Kind_Args {
    struct_size: usize,
    extension_start: Ext,
    device_description: *mut PJRT_DeviceDescription,
    device_kind: *const c_char,
    device_kind_size: usize,
});
pjrt_struct!(PJRT_DeviceDescription_DebugString_Args {
    struct_size: usize,
    extension_start: Ext,
    device_description: *mut PJRT_DeviceDescription,
    debug_string: *const c_char,
    debug_string_size: usize,
});
pjrt_struct!(PJRT_Device_GetDescription_Args {
    struct_size: usize,
    extension_start: Ext,
    device: *mut PJRT_Device,
    device_description: *mut PJRT_DeviceDescription,
});
pjrt_struct!(PJRT_Device_MemoryStats_Args {
    struct_size: usize,
    extension_start: Ext,
    device: *mut PJRT_Device,
    bytes_in_use: i64,
    peak_bytes_in_use: i64,
    peak_bytes_in_use_is_set: bool,
    num_allocs: i64,
    num_allocs_is_set: bool,
    largest_alloc_size: i64,
    largest_alloc_size_is_set: bool,
    bytes_limit: i64,
    bytes_limit_is_set: bool,
    bytes_reserved: i64,
    bytes_reserved_is_set: bool,
    peak_bytes_reserved: i64,
    peak_bytes_reserved_is_set: bool,
    bytes_reservable_limit: i64,
    bytes_reservable_limit_is_set: bool,
    largest_free_block_bytes: i64,
    largest_free_block_bytes_is_set: bool,
    pool_bytes: i64,
    pool_bytes_is_set: bool,
    peak_pool_bytes: i64,
    peak_pool_bytes_is_set: bool,
});

pjrt_struct!(PJRT_Executable_Destroy_Args {
    struct_size: usize,
    extension_start: Ext,
    executable: *mut PJRT_Executable,
});
pjrt_struct!(PJRT_LoadedExecutable_Destroy_Args {
    struct_size: usize,
    extension_start: Ext,
    executable: *mut PJRT_LoadedExecutable,
});
pjrt_struct!(PJRT_LoadedExecutable_GetExecutable_Args {
    struct_size: usize,
    extension_start: Ext,
    loaded_executable: *mut PJRT_LoadedExecutable,
    executable: *mut PJRT_Executable,
});
pjrt_struct!(PJRT_Executable_NumReplicas_Args {
    struct_size: usize,
    extension_start: Ext,
    executable: *mut PJRT_Executable,
    num_replicas: usize,
});
pjrt_struct!(PJRT_Executable_NumOutputs_Args {
    struct_size: usize,
    extension_start: Ext,
    executable: *mut PJRT_Executable,
    num_outputs: usize,
});
pjrt_struct!(PJRT_LoadedExecutable_AddressableDevices_Args {
    struct_size: usize,
    extension_start: Ext,
    executable: *mut PJRT_LoadedExecutable,
    addressable_devices: *const *mut PJRT_Device,
    num_addressable_devices: usize,
});
pjrt_struct!(PJRT_ExecuteOptions {
    struct_size: usize,
    extension_start: Ext,
    send_callbacks: *mut *mut PJRT_SendCallbackInfo,
    recv_callbacks: *mut *mut PJRT_RecvCallbackInfo,
    num_send_ops: usize,
    num_recv_ops: usize,
    launch_id: c_int,
    non_donatable_input_indices: *const i64,
    num_non_donatable_input_indices: usize,
    context: *mut PJRT_ExecuteContext,
    call_location: *const c_char,
    num_tasks: usize,
    task_ids: *mut c_int,
    incarnation_ids: *mut i64,
});
pjrt_struct!(PJRT_LoadedExecutable_Execute_Args {
    struct_size: usize,
    extension_start: Ext,
    executable: *mut PJRT_LoadedExecutable,
    options: *mut PJRT_ExecuteOptions,
    argument_lists: *const *const *mut PJRT_Buffer,
    num_devices: usize,
    num_args: usize,
    output_lists: *const *mut *mut PJRT_Buffer,
    device_complete_events: *mut *mut PJRT_Event,
    execute_device: *mut PJRT_Device,
});
pjrt_struct!(PJRT_Executable_Fingerprint_Args {
    struct_size: usize,
    extension_start: Ext,
    executable: *mut PJRT_Executable,
    executable_fingerprint: *const c_char,
    executable_fingerprint_size: usize,
});
pjrt_struct!(PJRT_Executable_GetCompiledMemoryStats_Args {
    struct_size: usize,
    extension_start: Ext,
    executable: *mut PJRT_Executable,
    generated_code_size_in_bytes: i64,
    argument_size_in_bytes: i64,
    output_size_in_bytes: i64,
    alias_size_in_bytes: i64,
    temp_size_in_bytes: i64,
    host_generated_code_size_in_bytes: i64,
    host_argument_size_in_bytes: i64,
    host_output_size_in_bytes: i64,
    host_alias_size_in_bytes: i64,
    host_temp_size_in_bytes: i64,
    peak_memory_in_bytes: i64,
});
pjrt_struct!(PJRT_Executable_Serialize_Args {
    struct_size: usize,
    extension_start: Ext,
    executable: *const PJRT_Executable,
    serialized_bytes: *const c_char,
    serialized_bytes_size: usize,
    serialized_executable: *mut PJRT_SerializedExecutable,
    serialized_executable_deleter: Option<unsafe extern "C" fn(*mut PJRT_SerializedExecutable)>,
});
pjrt_struct!(PJRT_Executable_DeserializeAndLoad_Args {
    struct_size: usize,
    extension_start: Ext,
    client: *mut PJRT_Client,
    serialized_executable: *const c_char,
    serialized_executable_size: usize,
    loaded_executable: *mut PJRT_LoadedExecutable,
    overridden_serialized_compile_options: *const c_char,
    overridden_serialized_compile_options_size: usize,
});

pjrt_struct!(PJRT_Buffer_Destroy_Args { struct_size: usize, extension_start: Ext, buffer: *mut PJRT_Buffer });
pjrt_struct!(PJRT_Buffer_ElementType_Args {
    struct_size: usize,
    extension_start: Ext,
    buffer: *mut PJRT_Buffer,
    #[c = "type"]
    type_: c_int,
});
pjrt_struct!(PJRT_Buffer_Dimensions_Args {
    struct_size: usize,
    extension_start: Ext,
    buffer: *mut PJRT_Buffer,
    dims: *const i64,
    num_dims: usize,
});
pjrt_struct!(PJRT_Buffer_ToHostBuffer_Args {
    struct_size: usize,
    extension_start: Ext,
    src: *mut PJRT_Buffer,
    host_layout: *mut PJRT_Buffer_MemoryLayout,
    dst: *mut c_void,
    dst_size: usize,
    event: *mut PJRT_Event,
});
pjrt_struct!(PJRT_Buffer_OnDeviceSizeInBytes_Args {
    struct_size: usize,
    extension_start: Ext,
    buffer: *mut PJRT_Buffer,
    on_device_size_in_bytes: usize,
});
pjrt_struct!(PJRT_Buffer_Device_Args {
    struct_size: usize,
    extension_start: Ext,
    buffer: *mut PJRT_Buffer,
    device: *mut PJRT_Device,
});

// The PJRT function table as of API 0.81 (all of it, so the layout test can
// compare its full size).
pjrt_struct!(PJRT_Api {
    struct_size: usize,
    extension_start: Ext,
    pjrt_api_version: PJRT_Api_Version,
    PJRT_Error_Destroy: VoidFn<PJRT_Error_Destroy_Args>,
    PJRT_Error_Message: VoidFn<PJRT_Error_Message_Args>,
    PJRT_Error_GetCode: ApiFn<PJRT_Error_GetCode_Args>,
    PJRT_Plugin_Initialize: ApiFn<PJRT_Plugin_Initialize_Args>,
    PJRT_Plugin_Attributes: Unused,
    PJRT_Event_Destroy: ApiFn<PJRT_Event_Destroy_Args>,
    PJRT_Event_IsReady: ApiFn<PJRT_Event_IsReady_Args>,
    PJRT_Event_Error: Unused,
    PJRT_Event_Await: ApiFn<PJRT_Event_Await_Args>,
    PJRT_Event_OnReady: Unused,
    PJRT_Client_Create: ApiFn<PJRT_Client_Create_Args>,
    PJRT_Client_Destroy: ApiFn<PJRT_Client_Destroy_Args>,
    PJRT_Client_PlatformName: ApiFn<PJRT_Client_PlatformName_Args>,
    PJRT_Client_ProcessIndex: ApiFn<PJRT_Client_ProcessIndex_Args>,
    PJRT_Client_PlatformVersion: Unused,
    PJRT_Client_Devices: ApiFn<PJRT_Client_Devices_Args>,
    PJRT_Client_AddressableDevices: ApiFn<PJRT_Client_AddressableDevices_Args>,
    PJRT_Client_LookupDevice: Unused,
    PJRT_Client_LookupAddressableDevice: Unused,
    PJRT_Client_AddressableMemories: Unused,
    PJRT_Client_Compile: ApiFn<PJRT_Client_Compile_Args>,
    PJRT_Client_DefaultDeviceAssignment: Unused,
    PJRT_Client_BufferFromHostBuffer: ApiFn<PJRT_Client_BufferFromHostBuffer_Args>,
    PJRT_DeviceDescription_Id: ApiFn<PJRT_DeviceDescription_Id_Args>,
    PJRT_DeviceDescription_ProcessIndex: ApiFn<PJRT_DeviceDescription_ProcessIndex_Args>,
    PJRT_DeviceDescription_Attributes: Unused,
    PJRT_DeviceDescription_Kind: ApiFn<PJRT_DeviceDescription_Kind_Args>,
    PJRT_DeviceDescription_DebugString: ApiFn<PJRT_DeviceDescription_DebugString_Args>,
    PJRT_DeviceDescription_ToString: Unused,
    PJRT_Device_GetDescription: ApiFn<PJRT_Device_GetDescription_Args>,
    PJRT_Device_IsAddressable: Unused,
    PJRT_Device_LocalHardwareId: Unused,
    PJRT_Device_AddressableMemories: Unused,
    PJRT_Device_DefaultMemory: Unused,
    PJRT_Device_MemoryStats: ApiFn<PJRT_Device_MemoryStats_Args>,
    PJRT_Memory_Id: Unused,
    PJRT_Memory_Kind: Unused,
    PJRT_Memory_DebugString: Unused,
    PJRT_Memory_ToString: Unused,
    PJRT_Memory_AddressableByDevices: Unused,
    PJRT_Executable_Destroy: ApiFn<PJRT_Executable_Destroy_Args>,
    PJRT_Executable_Name: Unused,
    PJRT_Executable_NumReplicas: ApiFn<PJRT_Executable_NumReplicas_Args>,
    PJRT_Executable_NumPartitions: Unused,
    PJRT_Executable_NumOutputs: ApiFn<PJRT_Executable_NumOutputs_Args>,
    PJRT_Executable_SizeOfGeneratedCodeInBytes: Unused,
    PJRT_Executable_GetCostAnalysis: Unused,
    PJRT_Executable_OutputMemoryKinds: Unused,
    PJRT_Executable_OptimizedProgram: Unused,
    PJRT_Executable_Serialize: ApiFn<PJRT_Executable_Serialize_Args>,
    PJRT_LoadedExecutable_Destroy: ApiFn<PJRT_LoadedExecutable_Destroy_Args>,
    PJRT_LoadedExecutable_GetExecutable: ApiFn<PJRT_LoadedExecutable_GetExecutable_Args>,
    PJRT_LoadedExecutable_AddressableDevices: ApiFn<PJRT_LoadedExecutable_AddressableDevices_Args>,
    PJRT_LoadedExecutable_Delete: Unused,
    PJRT_LoadedExecutable_IsDeleted: Unused,
    PJRT_LoadedExecutable_Execute: ApiFn<PJRT_LoadedExecutable_Execute_Args>,
    PJRT_Executable_DeserializeAndLoad: ApiFn<PJRT_Executable_DeserializeAndLoad_Args>,
    PJRT_LoadedExecutable_Fingerprint: Unused,
    PJRT_Buffer_Destroy: ApiFn<PJRT_Buffer_Destroy_Args>,
    PJRT_Buffer_ElementType: ApiFn<PJRT_Buffer_ElementType_Args>,
    PJRT_Buffer_Dimensions: ApiFn<PJRT_Buffer_Dimensions_Args>,
    PJRT_Buffer_UnpaddedDimensions: Unused,
    PJRT_Buffer_DynamicDimensionIndices: Unused,
    PJRT_Buffer_GetMemoryLayout: Unused,
    PJRT_Buffer_OnDeviceSizeInBytes: ApiFn<PJRT_Buffer_OnDeviceSizeInBytes_Args>,
    PJRT_Buffer_Device: ApiFn<PJRT_Buffer_Device_Args>,
    PJRT_Buffer_Memory: Unused,
    PJRT_Buffer_Delete: Unused,
    PJRT_Buffer_IsDeleted: Unused,
    PJRT_Buffer_CopyToDevice: Unused,
    PJRT_Buffer_ToHostBuffer: ApiFn<PJRT_Buffer_ToHostBuffer_Args>,
    PJRT_Buffer_IsOnCpu: Unused,
    PJRT_Buffer_ReadyEvent: Unused,
    PJRT_Buffer_UnsafePointer: Unused,
    PJRT_Buffer_IncreaseExternalReferenceCount: Unused,
    PJRT_Buffer_DecreaseExternalReferenceCount: Unused,
    PJRT_Buffer_OpaqueDeviceMemoryDataPointer: Unused,
    PJRT_CopyToDeviceStream_Destroy: Unused,
    PJRT_CopyToDeviceStream_AddChunk: Unused,
    PJRT_CopyToDeviceStream_TotalBytes: Unused,
    PJRT_CopyToDeviceStream_GranuleSize: Unused,
    PJRT_CopyToDeviceStream_CurrentBytes: Unused,
    PJRT_TopologyDescription_Create: Unused,
    PJRT_TopologyDescription_Destroy: Unused,
    PJRT_TopologyDescription_PlatformName: Unused,
    PJRT_TopologyDescription_PlatformVersion: Unused,
    PJRT_TopologyDescription_GetDeviceDescriptions: Unused,
    PJRT_TopologyDescription_Serialize: Unused,
    PJRT_TopologyDescription_Attributes: Unused,
    PJRT_Compile: Unused,
    PJRT_Executable_OutputElementTypes: Unused,
    PJRT_Executable_OutputDimensions: Unused,
    PJRT_Buffer_CopyToMemory: Unused,
    PJRT_Client_CreateViewOfDeviceBuffer: Unused,
    PJRT_Executable_Fingerprint: ApiFn<PJRT_Executable_Fingerprint_Args>,
    PJRT_Client_TopologyDescription: Unused,
    PJRT_Executable_GetCompiledMemoryStats: ApiFn<PJRT_Executable_GetCompiledMemoryStats_Args>,
    PJRT_Memory_Kind_Id: Unused,
    PJRT_ExecuteContext_Create: Unused,
    PJRT_ExecuteContext_Destroy: Unused,
    PJRT_Buffer_CopyRawToHost: Unused,
    PJRT_AsyncHostToDeviceTransferManager_Destroy: Unused,
    PJRT_AsyncHostToDeviceTransferManager_TransferData: Unused,
    PJRT_Client_CreateBuffersForAsyncHostToDevice: Unused,
    PJRT_AsyncHostToDeviceTransferManager_RetrieveBuffer: Unused,
    PJRT_AsyncHostToDeviceTransferManager_Device: Unused,
    PJRT_AsyncHostToDeviceTransferManager_BufferCount: Unused,
    PJRT_AsyncHostToDeviceTransferManager_BufferSize: Unused,
    PJRT_AsyncHostToDeviceTransferManager_SetBufferError: Unused,
    PJRT_AsyncHostToDeviceTransferManager_AddMetadata: Unused,
    PJRT_Client_DmaMap: Unused,
    PJRT_Client_DmaUnmap: Unused,
    PJRT_Client_CreateUninitializedBuffer: Unused,
    PJRT_Client_UpdateGlobalProcessInfo: Unused,
    PJRT_TopologyDescription_Deserialize: Unused,
    PJRT_Client_CreateAliasBuffer: Unused,
    PJRT_Client_FulfillAliasBuffer: Unused,
    PJRT_LoadedExecutable_GetDeviceAssignment: Unused,
});

/// Every declared struct, for the header-conformance test.
pub const ALL_LAYOUTS: &[StructLayout] = &[
    PJRT_Extension_Base::LAYOUT,
    PJRT_Api_Version::LAYOUT,
    PJRT_Error_Destroy_Args::LAYOUT,
    PJRT_Error_Message_Args::LAYOUT,
    PJRT_Error_GetCode_Args::LAYOUT,
    PJRT_NamedValue::LAYOUT,
    PJRT_Plugin_Initialize_Args::LAYOUT,
    PJRT_Event_Destroy_Args::LAYOUT,
    PJRT_Event_Await_Args::LAYOUT,
    PJRT_Event_IsReady_Args::LAYOUT,
    PJRT_KeyValueGetCallback_Args::LAYOUT,
    PJRT_KeyValueTryGetCallback_Args::LAYOUT,
    PJRT_KeyValuePutCallback_Args::LAYOUT,
    PJRT_Client_Create_Args::LAYOUT,
    PJRT_Client_ProcessIndex_Args::LAYOUT,
    PJRT_Client_Devices_Args::LAYOUT,
    PJRT_DeviceDescription_ProcessIndex_Args::LAYOUT,
    PJRT_Client_Destroy_Args::LAYOUT,
    PJRT_Client_PlatformName_Args::LAYOUT,
    PJRT_Client_AddressableDevices_Args::LAYOUT,
    PJRT_Program::LAYOUT,
    PJRT_Client_Compile_Args::LAYOUT,
    PJRT_Client_BufferFromHostBuffer_Args::LAYOUT,
    PJRT_DeviceDescription_Id_Args::LAYOUT,
    PJRT_DeviceDescription_Kind_Args::LAYOUT,
    PJRT_DeviceDescription_DebugString_Args::LAYOUT,
    PJRT_Device_GetDescription_Args::LAYOUT,
    PJRT_Device_MemoryStats_Args::LAYOUT,
    PJRT_Executable_Destroy_Args::LAYOUT,
    PJRT_LoadedExecutable_Destroy_Args::LAYOUT,
    PJRT_LoadedExecutable_GetExecutable_Args::LAYOUT,
    PJRT_Executable_NumReplicas_Args::LAYOUT,
    PJRT_Executable_NumOutputs_Args::LAYOUT,
    PJRT_LoadedExecutable_AddressableDevices_Args::LAYOUT,
    PJRT_ExecuteOptions::LAYOUT,
    PJRT_LoadedExecutable_Execute_Args::LAYOUT,
    PJRT_Executable_Fingerprint_Args::LAYOUT,
    PJRT_Executable_GetCompiledMemoryStats_Args::LAYOUT,
    PJRT_Executable_Serialize_Args::LAYOUT,
    PJRT_Executable_DeserializeAndLoad_Args::LAYOUT,
    PJRT_Buffer_Destroy_Args::LAYOUT,
    PJRT_Buffer_ElementType_Args::LAYOUT,
    PJRT_Buffer_Dimensions_Args::LAYOUT,
    PJRT_Buffer_ToHostBuffer_Args::LAYOUT,
    PJRT_Buffer_OnDeviceSizeInBytes_Args::LAYOUT,
    PJRT_Buffer_Device_Args::LAYOUT,
    PJRT_Api::LAYOUT,
];
