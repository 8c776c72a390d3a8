#!/bin/bash
# Builds the CUPTI injection library of ktrace.c as /tmp/ktrace.so, against
# whichever CUPTI headers and library the device machine has (the CUDA toolkit's
# or a Python wheel's), for the newest kernel activity record they define.
# Prints what it found; the tracing scripts call it first.
D=$(cd "$(dirname "$0")" && pwd)
SP=$(python3 -c "import site;print(site.getsitepackages()[0])")
INC=$(dirname "$(find /usr/local /opt $SP -name cupti_activity.h 2>/dev/null | grep -v deprecated | head -1)")
CUDAH=$(dirname "$(find /usr/local/cuda/include /usr/local /opt $SP -name cuda.h 2>/dev/null | head -1)")
LIB=$(dirname "$(find $SP /usr/local /opt -name "libcupti.so*" 2>/dev/null | head -1)")
KV=$(grep -o 'CUpti_ActivityKernel[0-9]*' $INC/cupti_activity.h | sort -V | tail -1)
echo "cupti inc $INC cuda.h $CUDAH lib $LIB rec $KV"
gcc -shared -fPIC -O2 -DKREC=$KV -I$INC -I$CUDAH $D/ktrace.c -o /tmp/ktrace.so -L$LIB \
  -l:$(ls $LIB | grep '^libcupti.so' | head -1) -Wl,-rpath,$LIB 2>&1 | tail -5
ls -la /tmp/ktrace.so
