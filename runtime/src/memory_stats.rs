//! What a compiled program needs of device memory, as the plugin reports it:
//! plain data, read by the executable and the PJRT handles alike.

/// Memory the compiled program needs, from `PJRT_Executable_GetCompiledMemoryStats`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CompiledMemoryStats {
    pub generated_code_size_in_bytes: i64,
    pub argument_size_in_bytes: i64,
    pub output_size_in_bytes: i64,
    /// How much argument memory is reused for outputs.
    pub alias_size_in_bytes: i64,
    pub temp_size_in_bytes: i64,
    pub host_generated_code_size_in_bytes: i64,
    pub host_argument_size_in_bytes: i64,
    pub host_output_size_in_bytes: i64,
    pub host_alias_size_in_bytes: i64,
    pub host_temp_size_in_bytes: i64,
    /// The plugin's own peak, whose meaning differs by plugin: the CUDA
    /// plugin counts temporaries in it, the XLA CPU plugin 0.0.1 about
    /// arguments + outputs only. [`held_bytes`](Self::held_bytes) means the
    /// same on both.
    pub peak_memory_in_bytes: i64,
}

impl CompiledMemoryStats {
    /// What the program holds at once on the device: arguments and outputs
    /// (aliased outputs counted once) and temporaries.
    pub fn held_bytes(&self) -> i64 {
        self.argument_size_in_bytes + self.output_size_in_bytes - self.alias_size_in_bytes + self.temp_size_in_bytes
    }
}
