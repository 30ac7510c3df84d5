# Install llama-cpp-python built for one variant into the build environment (Windows).
#
#   installers\build_llama.ps1 -Variant cpu|cuda|vulkan [-Version 0.3.36] [-Python .venv\Scripts\python.exe]
#
# The variants and the toolchain each needs (plus Visual Studio 2022 Build Tools with the C++
# workload, and CMake, for all of them):
#   cpu     CMAKE_ARGS none
#   cuda    -DGGML_CUDA=on      the CUDA toolkit (CUDA_PATH set, nvcc on PATH)
#   vulkan  -DGGML_VULKAN=on    the Vulkan SDK (VULKAN_SDK set, glslc on PATH)
# Every variant also gets -DGGML_RPC=on (llama.cpp's RPC backend, for model groups, issue 19).
# $env:LLAMA_EXTRA_CMAKE_ARGS is appended (e.g. "-DCMAKE_CUDA_ARCHITECTURES=61;75;86;89").
param(
    [Parameter(Mandatory = $true)][ValidateSet("cpu", "cuda", "vulkan")][string]$Variant,
    [string]$Version = "",
    [string]$Python = ""
)
$ErrorActionPreference = "Stop"
$Root = Resolve-Path (Join-Path $PSScriptRoot "..")
if (-not $Python) {
    $venv = Join-Path $Root ".venv\Scripts\python.exe"
    $Python = if (Test-Path $venv) { $venv } else { "python" }
}
switch ($Variant) {
    "cpu"    { $cmake = "" }
    "cuda"   { $cmake = "-DGGML_CUDA=on"
               if (-not (Get-Command nvcc -ErrorAction SilentlyContinue)) { throw "cuda needs nvcc (the CUDA toolkit) on PATH" } }
    "vulkan" { $cmake = "-DGGML_VULKAN=on"
               if (-not $env:VULKAN_SDK) { throw "vulkan needs the Vulkan SDK (VULKAN_SDK is not set)" } }
}
$cmake = ("$cmake -DGGML_RPC=on " + $env:LLAMA_EXTRA_CMAKE_ARGS).Trim()
if (-not $Version) {
    $Version = & $Python -c "from importlib.metadata import version`ntry: print(version('llama-cpp-python'))`nexcept Exception: print('')"
}
$spec = if ($Version) { "llama-cpp-python==$Version" } else { "llama-cpp-python" }
Write-Host "==> $spec for ${Variant}: CMAKE_ARGS='$cmake'"
$env:CMAKE_ARGS = $cmake
$env:FORCE_CMAKE = "1"
# --no-cache-dir: pip's wheel cache would hand back a build of another variant.
& $Python -m pip install --force-reinstall --no-deps --no-cache-dir --no-binary llama-cpp-python $spec
if ($LASTEXITCODE) { throw "pip install failed ($LASTEXITCODE)" }
& $Python -m pip install $spec  # its dependencies, if this environment lacks them
if ($LASTEXITCODE) { throw "pip install failed ($LASTEXITCODE)" }
& $Python -c "import llama_cpp; from llama_cpp import llama_cpp as lib; print('llama-cpp-python', llama_cpp.__version__, 'GPU offload:', bool(lib.llama_supports_gpu_offload()), 'RPC:', bool(lib.llama_supports_rpc()))"
if ($LASTEXITCODE) { throw "llama_cpp does not import" }

# The image engine (issue 38): stable-diffusion-cpp-python for the same variant (SD_CUDA /
# SD_VULKAN); the cpu variant keeps the CPU build the worker's extra installs.
$sdCmake = switch ($Variant) { "cuda" { "-DSD_CUDA=ON" } "vulkan" { "-DSD_VULKAN=ON" } default { "" } }
if ($sdCmake) {
    $sdVersion = & $Python -c "from importlib.metadata import version`ntry: print(version('stable-diffusion-cpp-python'))`nexcept Exception: print('')"
    $sdSpec = if ($sdVersion) { "stable-diffusion-cpp-python==$sdVersion" } else { "stable-diffusion-cpp-python" }
    Write-Host "==> $sdSpec for ${Variant}: CMAKE_ARGS='$sdCmake'"
    $env:CMAKE_ARGS = $sdCmake
    & $Python -m pip install --force-reinstall --no-deps --no-cache-dir --no-binary stable-diffusion-cpp-python $sdSpec
    if ($LASTEXITCODE) { throw "pip install failed ($LASTEXITCODE)" }
}
