; Inno Setup 6 script of the Windows desktop worker: a per-user install (no admin prompt) with a
; Start-menu entry, an optional autostart at sign-in and an uninstaller. Uninstalling keeps the
; user's settings, worker key and models (they live in the user's data folders, not in {app}).
; build.ps1 compiles it:
;   iscc /DAppVersion=0.1.0 /DVariant=cpu /DAppDir=...\apiary-worker /DIconFile=...\apiary-worker.ico
;        /DOutputDir=...\dist installers\windows\apiary-worker.iss
#ifndef AppVersion
  #error Pass /DAppVersion=X.Y.Z (build.ps1 does)
#endif
#ifndef AppDir
  #error Pass /DAppDir=<the PyInstaller app folder> (build.ps1 does)
#endif
#ifndef Variant
  #define Variant "cpu"
#endif
#ifndef OutputDir
  #define OutputDir "..\dist"
#endif

[Setup]
; One AppId for every variant: installing the CUDA build over the CPU one replaces it.
AppId={{6D3F4A52-8E1B-4C57-9A2E-3B7C1D0E5F91}
AppName=Apiary Worker
AppVersion={#AppVersion}
AppVerName=Apiary Worker {#AppVersion} ({#Variant})
AppPublisher=Apiary developers
AppPublisherURL=https://apiary.net
DefaultDirName={autopf}\Apiary Worker
DefaultGroupName=Apiary Worker
DisableProgramGroupPage=yes
; Per-user: {autopf} is %LOCALAPPDATA%\Programs, the registry is HKCU, no UAC prompt.
PrivilegesRequired=lowest
PrivilegesRequiredOverridesAllowed=dialog
ArchitecturesAllowed=x64compatible
ArchitecturesInstallIn64BitMode=x64compatible
OutputDir={#OutputDir}
OutputBaseFilename=apiary-worker-{#AppVersion}-windows-{#Variant}-x86_64-setup
#ifdef IconFile
SetupIconFile={#IconFile}
#endif
UninstallDisplayIcon={app}\apiary-worker.exe
UninstallDisplayName=Apiary Worker
Compression=lzma2/max
SolidCompression=yes
WizardStyle=modern
; Ask a running worker to close (Restart Manager) before files are replaced or removed.
CloseApplications=yes
RestartApplications=no

[Languages]
Name: "english"; MessagesFile: "compiler:Default.isl"

[Tasks]
Name: "autostart"; Description: "Start Apiary Worker when I sign in"; GroupDescription: "Startup:"; Flags: unchecked
Name: "desktopicon"; Description: "{cm:CreateDesktopIcon}"; GroupDescription: "{cm:AdditionalIcons}"; Flags: unchecked

[Files]
Source: "{#AppDir}\*"; DestDir: "{app}"; Flags: ignoreversion recursesubdirs createallsubdirs

[Icons]
Name: "{group}\Apiary Worker"; Filename: "{app}\apiary-worker.exe"; Comment: "Lend your GPU to an Apiary swarm"
Name: "{group}\Uninstall Apiary Worker"; Filename: "{uninstallexe}"
Name: "{autodesktop}\Apiary Worker"; Filename: "{app}\apiary-worker.exe"; Tasks: desktopicon

[Registry]
; The autostart task: the app at sign-in, from the current user's Run key (removed on uninstall).
Root: HKCU; Subkey: "Software\Microsoft\Windows\CurrentVersion\Run"; ValueType: string; ValueName: "ApiaryWorker"; ValueData: """{app}\apiary-worker.exe"""; Flags: uninsdeletevalue; Tasks: autostart
; The app's own "Run at login" setting writes the same value; uninstalling removes it either way.
Root: HKCU; Subkey: "Software\Microsoft\Windows\CurrentVersion\Run"; ValueType: none; ValueName: "ApiaryWorker"; Flags: uninsdeletevalue

[Run]
Filename: "{app}\apiary-worker.exe"; Description: "{cm:LaunchProgram,Apiary Worker}"; Flags: nowait postinstall skipifsilent

[UninstallRun]
; Stop a worker still running from this folder (its tray icon may be hidden).
Filename: "{sys}\taskkill.exe"; Parameters: "/f /t /im apiary-worker.exe"; Flags: runhidden; RunOnceId: "StopApiaryWorker"
