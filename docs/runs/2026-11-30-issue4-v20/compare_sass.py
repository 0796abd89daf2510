import re, sys
sys.path.insert(0,'/work/main/tools')
import kernel_report as kr
def kern(path, want="blocked_matmul_kernel"):
    text=open(path).read()
    parts=re.split(r"\n\s*Function : ", text)
    for p in parts[1:]:
        name=p.split("\n")[0]
        if want in name:
            return [(int(m.group(1),16), m.group(2)) for m in (re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+([^;]*);", l) for l in p.splitlines()) if m]
for path in sys.argv[1:]:
    code=kern(path)
    print(path, len(code), kr.global_accesses(code)); [print("  ",l) for l in kr.loops(code)]
    idx=[i for i,(a,x) in enumerate(code) if 'LDG' in x or 'BAR' in x or 'STS' in x or re.search(r'BRA 0x', x)]
    print("  ", " ".join(f"{i}:{re.sub('^@!?U?P[0-9T]+ ','',code[i][1]).split()[0]}" for i in idx))
