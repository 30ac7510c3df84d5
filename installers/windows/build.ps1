# Build the Windows desktop worker: the app folder, a portable zip and the Inno Setup installer.
#
#   installers\windows\build.ps1 [-Variant cpu|cuda|vulkan] [-Out installers\dist] [-Python ...]
#
# Needs: Apiary installed in the build environment with the variant's llama-cpp-python
# (installers\build_llama.ps1 -Variant ...), and Inno Setup 6 (iscc.exe on PATH or in its default
# folder; `choco install innosetup`). Outputs in -Out:
#   apiary-worker-<ver>-windows-<variant>-x86_64-setup.exe
#   apiary-worker-<ver>-windows-<variant>-x86_64.zip        (portable: unzip, run apiary-worker.exe)
# If SIGNTOOL_CERT (a .pfx path) and SIGNTOOL_PASSWORD are set, the executables and the
# installer are signed with signtool.
param(
    [ValidateSet("cpu", "cuda", "vulkan")][string]$Variant = "cpu",
    [string]$Out = "",
    [string]$Python = ""
)
$ErrorActionPreference = "Stop"
$Root = (Resolve-Path (Join-Path $PSScriptRoot "..\..")).Path
if (-not $Out) { $Out = Join-Path $Root "installers\dist" }
New-Item -ItemType Directory -Force -Path $Out | Out-Null
$Out = (Resolve-Path $Out).Path
if (-not $Python) {
    $venv = Join-Path $Root ".venv\Scripts\python.exe"
    $Python = if (Test-Path $venv) { $venv } else { "python" }
}
$Version = (& $Python -c "import desktop_worker; print(desktop_worker.__version__)").Trim()
$Name = "apiary-worker-$Version-windows-$Variant-x86_64"
$Work = Join-Path $Root "installers\build\windows-$Variant"
New-Item -ItemType Directory -Force -Path $Work | Out-Null

Write-Host "==> icon"
$Icon = Join-Path $Work "apiary-worker.ico"
& $Python (Join-Path $Root "installers\render_icon.py") (Join-Path $Root "resources\icons\app.svg") --ico $Icon
if ($LASTEXITCODE) { throw "render_icon failed" }

Write-Host "==> app folder ($Variant)"
$env:APIARY_VARIANT = $Variant
$env:APIARY_ICON = $Icon
& $Python -m PyInstaller --noconfirm --log-level WARN --distpath (Join-Path $Work "dist") `
    --workpath (Join-Path $Work "pyinstaller-work") (Join-Path $Root "installers\apiary-worker.spec")
if ($LASTEXITCODE) { throw "PyInstaller failed" }
$App = Join-Path $Work "dist\apiary-worker"
& (Join-Path $App "apiary-worker-cli.exe") --version
if ($LASTEXITCODE) { throw "the built app does not run" }

function Sign-Files([string[]]$Files) {
    if (-not $env:SIGNTOOL_CERT) { return }
    $signtool = (Get-Command signtool -ErrorAction SilentlyContinue).Source
    if (-not $signtool) {  # the Windows SDK's, which is not on PATH on CI runners
        $signtool = (Get-ChildItem "${env:ProgramFiles(x86)}\Windows Kits\10\bin\*\x64\signtool.exe" |
            Sort-Object FullName | Select-Object -Last 1).FullName
    }
    if (-not $signtool) { throw "SIGNTOOL_CERT is set but signtool.exe is not found" }
    & $signtool sign /f $env:SIGNTOOL_CERT /p $env:SIGNTOOL_PASSWORD /fd sha256 `
        /tr http://timestamp.digicert.com /td sha256 @Files
    if ($LASTEXITCODE) { throw "signtool failed" }
}
Sign-Files @((Join-Path $App "apiary-worker.exe"), (Join-Path $App "apiary-worker-cli.exe"))

Write-Host "==> portable zip"
$Zip = Join-Path $Out "$Name.zip"
if (Test-Path $Zip) { Remove-Item $Zip }
Compress-Archive -Path $App -DestinationPath $Zip

Write-Host "==> installer"
$Iscc = (Get-Command iscc -ErrorAction SilentlyContinue).Source
if (-not $Iscc) { $Iscc = Join-Path ${env:ProgramFiles(x86)} "Inno Setup 6\ISCC.exe" }
if (-not (Test-Path $Iscc)) { throw "Inno Setup 6 is not installed (choco install innosetup)" }
& $Iscc "/DAppVersion=$Version" "/DVariant=$Variant" "/DAppDir=$App" "/DIconFile=$Icon" `
    "/DOutputDir=$Out" (Join-Path $PSScriptRoot "apiary-worker.iss")
if ($LASTEXITCODE) { throw "iscc failed" }
Sign-Files @((Join-Path $Out "$Name-setup.exe"))
Get-ChildItem $Out -Filter "$Name*" | Format-Table Name, Length
